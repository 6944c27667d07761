"""Where a region's own requests (not guests) waited for their first token, recorded inside
the services as requests finish: the regions bench's ``local`` reply (``region_mesh.py``
in one process, ``region_service.py`` per service).

Parts (``WAIT_PARTS``), in ms per request: the gateway's arrival -> its executor's receipt,
-> the start of the step that scheduled it, -> its first token, and its TTFT as the gateway
measured it.
"""

from __future__ import annotations

import threading
from typing import Any

from services.executor.service import ExecutorService
from services.gateway.app import GatewayServer

WAIT_PARTS = ("to_executor_ms", "queue_ms", "first_step_ms", "gateway_ttft_ms")


class WaitTimes:
    """Times recorded by the hooks below, taken (and cleared) by ``take``."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {part: [] for part in WAIT_PARTS}
        self.lock = threading.Lock()

    def add(self, part: str, ms: float) -> None:
        with self.lock:
            self.times[part].append(ms)

    def take(self) -> dict[str, list[float]]:
        with self.lock:
            taken, self.times = self.times, {part: [] for part in WAIT_PARTS}
        return taken

    def watch_gateway(self, gateway: GatewayServer) -> None:
        """Every TTFT this gateway observes (its clients are all the region's own)."""
        ttft = gateway.mesh.metrics.ttft
        observe = ttft.observe

        def observed(amount: float, exemplar: Any = None) -> None:
            self.add("gateway_ttft_ms", 1000 * amount)
            observe(amount, exemplar)

        ttft.observe = observed  # type: ignore[method-assign]

    def watch_executor(self, executor: ExecutorService) -> None:
        """The executor-side parts of each of its own requests, read as it forgets one."""
        forget = executor.forget

        def record(request_id: str, reason: str = "abort") -> None:
            req = executor.requests.get(request_id)  # still there: forget drops it
            timeline = executor.timelines.active.get(request_id)
            if req is not None and not req.guest and timeline and timeline.first_token_ns:
                received_ms = timeline.received_ns / 1e6
                scheduled_ms = timeline.scheduled_ns / 1e6
                self.add("to_executor_ms", received_ms - 1000 * req.arrival_time)
                self.add("queue_ms", scheduled_ms - received_ms)
                self.add("first_step_ms", timeline.first_token_ns / 1e6 - scheduled_ms)
            forget(request_id, reason)

        executor.forget = record  # type: ignore[method-assign]


def merged(replies: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Several services' ``take()`` as one."""
    return {part: [t for r in replies for t in r.get(part, [])] for part in WAIT_PARTS}
