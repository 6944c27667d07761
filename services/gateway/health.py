"""Which stages of the mesh are alive, as the gateway sees them (pure; no NATS).

Every service announces its presence about once a second (``common/runtime.py``); executors
also send load heartbeats, and those decide whether an executor counts (it may be draining, or
refused for paging its KV cache unlike the tokenizer, ``common/mesh_facts.py``). A required
stage with no live member makes ``/health`` 503 and fails new requests at once with a 503
naming the stage: nothing would answer them, and they would otherwise wait for their deadline.
Right after the gateway starts, members may not have announced themselves yet: for
``startup_grace_s`` a missing stage is reported as ``starting`` and requests wait for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from common.mesh_facts import page_size_refusals
from common.wire.presence import Presence
from common.wire.scheduler import Heartbeat

# Stage names are the services' runtime names (``Service(name, ...)``), as announced.
STAGES = ("tokenizer", "scheduler", "detokenizer", "executor", "prefix-index", "speculator")
# The prefix index only improves routing (the scheduler routes by load without it) and the
# speculator only speeds decoding (executors fall back to plain steps): optional unless
# configured as required (--required-stages).
REQUIRED_STAGES = ("tokenizer", "scheduler", "detokenizer", "executor")


class ExecutorLiveness:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._seen: dict[str, tuple[float, Heartbeat]] = {}  # executor id -> (monotonic, last)

    def saw(self, heartbeat: Heartbeat) -> None:
        self._seen[heartbeat.executor_id] = (time.monotonic(), heartbeat)

    def recent(self) -> dict[str, Heartbeat]:
        """The last heartbeat of every executor heard from within the TTL."""
        horizon = time.monotonic() - self.ttl_s
        for executor_id in [e for e, (t, _) in self._seen.items() if t < horizon]:
            del self._seen[executor_id]  # forget executors that went away
        return {e: hb for e, (_, hb) in self._seen.items()}

    def live(self) -> list[str]:
        """Executors heard from within the TTL that are not draining."""
        return [e for e, hb in self.recent().items() if not hb.draining]

    def loras(self) -> tuple[str, ...]:
        """The LoRA adapters the executors heard from within the TTL serve, sorted."""
        return tuple(sorted({n for hb in self.recent().values() for n in hb.loras or ()}))


@dataclass
class Member:
    seen: float  # monotonic time of its last announcement
    presence: Presence


class MeshLiveness:
    """Live members per stage, from presence announcements and executor heartbeats."""

    def __init__(
        self,
        required: Iterable[str] = REQUIRED_STAGES,
        presence_ttl_s: float = 3.0,
        heartbeat_ttl_s: float = 5.0,
        startup_grace_s: float = 3.0,
    ) -> None:
        self.required = tuple(required)
        unknown = set(self.required) - set(STAGES)
        if unknown:
            raise ValueError(f"unknown stages {sorted(unknown)}; stages are {STAGES}")
        self.presence_ttl_s = presence_ttl_s
        self.startup_grace_s = startup_grace_s
        self.executors = ExecutorLiveness(heartbeat_ttl_s)
        self._members: dict[str, dict[str, Member]] = {}  # stage -> instance id -> member
        # Facts announced by tokenizers, kept after they leave: a restarted tokenizer is
        # expected to page and shard as the last one did until it says otherwise.
        self.detok_shards = 1
        self.page_size: int | None = None
        self.tool_format = "hermes"  # common.tool_formats.HERMES until a tokenizer says
        self.started = time.monotonic()

    def start(self) -> None:
        """The grace period runs from now (the gateway subscribed to announcements)."""
        self.started = time.monotonic()

    def in_grace(self) -> bool:
        return time.monotonic() - self.started < self.startup_grace_s

    @property
    def grace_ends(self) -> float:
        """Monotonic time at which the start-up grace ends."""
        return self.started + self.startup_grace_s

    # -- input ------------------------------------------------------------------------------
    def saw(self, presence: Presence) -> None:
        if presence.service not in STAGES or presence.service == "executor":
            return  # executors count by their heartbeats; other gateways are no stage
        members = self._members.setdefault(presence.service, {})
        members[presence.instance_id] = Member(time.monotonic(), presence)
        if presence.service == "tokenizer" and not presence.draining:
            if presence.detok_shards is not None:
                self.detok_shards = presence.detok_shards
            if presence.page_size is not None:
                self.page_size = presence.page_size
            if presence.tool_format is not None:
                self.tool_format = presence.tool_format

    def saw_heartbeat(self, heartbeat: Heartbeat) -> None:
        self.executors.saw(heartbeat)

    # -- views ------------------------------------------------------------------------------
    def live(self, stage: str) -> list[Presence]:
        """Members of ``stage`` that announced themselves within the TTL, not draining."""
        members = self._members.get(stage, {})
        horizon = time.monotonic() - self.presence_ttl_s
        for instance in [i for i, m in members.items() if m.seen < horizon]:
            del members[instance]  # gone without a word (killed): forget it
        return [m.presence for m in members.values() if not m.presence.draining]

    def tokenizers_behind_since(self) -> float | None:
        """The earliest arrival time a live tokenizer is still working through with more
        waiting behind it (``Presence.behind_since``), or None when none has a backlog: a
        request that arrived after it may be queued there, unknown to the scheduler yet."""
        times = [p.behind_since for p in self.live("tokenizer") if p.behind_since is not None]
        return min(times, default=None)

    def tokenizer_page_sizes(self) -> list[int]:
        sizes = [p.page_size for p in self.live("tokenizer") if p.page_size is not None]
        return sizes or ([self.page_size] if self.page_size is not None else [])

    def executor_view(self) -> tuple[list[str], list[str], dict[str, str]]:
        """(live, draining, refused) executors; a live one is neither draining nor refused."""
        recent = self.executors.recent()
        refused = page_size_refusals(
            self.tokenizer_page_sizes(), {e: hb.page_size for e, hb in recent.items()}
        )
        draining = sorted(e for e, hb in recent.items() if hb.draining)
        live = sorted(e for e in recent if e not in refused and e not in draining)
        return live, draining, refused

    def missing(self) -> dict[str, str]:
        """Each required stage (detokenizers: each shard) with no live member, and why."""
        out: dict[str, str] = {}
        for stage in self.required:
            if stage == "executor":
                live, draining, refused = self.executor_view()
                if not live:
                    why = "no live executor in the mesh"
                    if refused:
                        why += " (refused: " + "; ".join(refused.values()) + ")"
                    elif draining:
                        why += " (every executor is draining)"
                    else:
                        why += f" (no executor heartbeat in the last {self.executors.ttl_s:g} s)"
                    out["executor"] = why
            elif stage == "detokenizer":
                shards = {p.shard or 0 for p in self.live("detokenizer")}
                for shard in range(self.detok_shards):
                    if shard not in shards:
                        name = "detokenizer"
                        if self.detok_shards > 1:
                            name += f" shard {shard}"
                        what = "" if self.detok_shards == 1 else f" for shard {shard}"
                        out[name] = f"no live detokenizer{what} in the mesh"
            elif not self.live(stage):
                out[stage] = f"no live {stage} in the mesh"
        return out

    def problem(self) -> str | None:
        """Why the mesh cannot serve now, or None when every required stage has a member."""
        missing = self.missing()
        return "; ".join(missing.values()) if missing else None

    def report(self) -> dict[str, Any]:
        """Every stage, required or not, with its live members (the body of ``/health``)."""
        stages: dict[str, Any] = {}
        for stage in STAGES:
            entry: dict[str, Any] = {"required": stage in self.required}
            if stage == "executor":
                live, draining, refused = self.executor_view()
                entry |= {"live": live, "draining": draining, "refused": refused}
            else:
                members = self.live(stage)
                entry["live"] = sorted(p.instance_id for p in members)
                if stage == "detokenizer":
                    entry["shards"] = {
                        str(shard): sorted(
                            p.instance_id for p in members if (p.shard or 0) == shard
                        )
                        for shard in range(self.detok_shards)
                    }
            stages[stage] = entry
        return stages
