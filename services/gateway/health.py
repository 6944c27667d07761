"""Executor liveness from heartbeats: /health is ready while some executor reported recently."""

from __future__ import annotations

import time

from common.messages import Heartbeat


class ExecutorLiveness:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._seen: dict[str, tuple[float, bool]] = {}  # executor id -> (monotonic time, draining)

    def saw(self, heartbeat: Heartbeat) -> None:
        self._seen[heartbeat.executor_id] = (time.monotonic(), heartbeat.draining)

    def live(self) -> list[str]:
        """Executors heard from within the TTL that are not draining."""
        horizon = time.monotonic() - self.ttl_s
        for executor_id in [e for e, (t, _) in self._seen.items() if t < horizon]:
            del self._seen[executor_id]  # forget executors that went away
        return [e for e, (_, draining) in self._seen.items() if not draining]

    def problem(self) -> str | None:
        """Why the mesh cannot serve now, or None when some executor is live."""
        if self.live():
            return None
        if self._seen:
            return "every executor is draining"
        return f"no executor heartbeat in the last {self.ttl_s:g} s"
