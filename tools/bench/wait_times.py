"""Where a region's own requests (not guests) waited for their first token, recorded inside
the services as requests go: the regions bench's ``local`` reply (``region_mesh.py`` in one
process, ``region_service.py`` per service).

Each service stamps the moments it sees of each request (wall clock, ms; one machine, one
clock), ``parts`` joins them by request id for the requests an executor served as its
region's own. Parts (``WAIT_PARTS``), in ms per request: the gateway's submit -> its
executor's receipt, -> the start of the step that scheduled it, -> its first token, -> the
detokenizer's turn to it, -> the gateway's receipt of its text, -> the request's handler
taking that text; and the TTFT the gateway measured (from just before the submit to the
handler taking the text, not joined: one per request of the region's own clients).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from common.wire.gateway import TextDelta
from services.detokenizer.service import DetokenizerService
from services.executor.service import ExecutorService
from services.gateway.app import GatewayServer
from services.gateway.observe import RequestObserver
from services.gateway.streams import RequestStream

# (part, the moment it starts, the moment it ends)
LEGS = (
    ("to_executor_ms", "submitted", "received"),
    ("queue_ms", "received", "scheduled"),
    ("first_step_ms", "scheduled", "first_token"),
    ("to_detok_ms", "first_token", "detokenized"),
    ("to_gateway_ms", "detokenized", "at_gateway"),
    ("in_gateway_ms", "at_gateway", "observed"),
)
WAIT_PARTS = (*(leg for leg, _, _ in LEGS), "gateway_ttft_ms")

Taken = dict[str, Any]  # {"moments": {request id: {moment: ms}}, "gateway_ttft_ms": [...]}


class WaitTimes:
    """The moments recorded by the hooks below, taken (and cleared) by ``take``."""

    def __init__(self) -> None:
        self.moments: dict[str, dict[str, float]] = {}
        self.ttft: list[float] = []
        self.lock = threading.Lock()

    def stamp(self, request_id: str, moment: str, ms: float | None = None) -> None:
        with self.lock:
            seen = self.moments.setdefault(request_id, {})
            seen.setdefault(moment, time.time() * 1000 if ms is None else ms)  # the first

    def take(self) -> Taken:
        with self.lock:
            taken = {"moments": self.moments, "gateway_ttft_ms": self.ttft}
            self.moments, self.ttft = {}, []
        return taken

    def watch_gateway(self, gateway: GatewayServer) -> None:
        """Every TTFT this gateway observes (its clients are all the region's own), and when
        each request's first text reached it."""
        ttft = gateway.mesh.metrics.ttft
        observe = ttft.observe

        def observed(amount: float, exemplar: Any = None) -> None:
            with self.lock:
                self.ttft.append(1000 * amount)
            observe(amount, exemplar)

        ttft.observe = observed  # type: ignore[method-assign]
        # The classes' methods below: this process's gateway is the only one.
        seen = RequestObserver.delta

        def delta(observer: RequestObserver, index: int, delta: TextDelta) -> None:
            self.stamp(delta.request_id, "observed")  # the handler has the text
            seen(observer, index, delta)

        RequestObserver.delta = delta  # type: ignore[method-assign, assignment]
        put = RequestStream.put  # each event the inbox routes to a request's stream

        def routed(stream: RequestStream, event: Any) -> None:
            if isinstance(event, TextDelta):
                self.stamp(event.request_id, "at_gateway")
            put(stream, event)

        RequestStream.put = routed  # type: ignore[method-assign, assignment]

    def watch_detokenizer(self, detok: DetokenizerService) -> None:
        """When the detokenizer turned to each stream's first tokens."""
        advance: Callable[..., Any] = detok.advance

        def advanced(stream: Any, seq: Any) -> Any:
            self.stamp(seq.request_id, "detokenized")
            return advance(stream, seq)

        detok.advance = advanced  # type: ignore[method-assign]

    def watch_executor(self, executor: ExecutorService) -> None:
        """The executor-side moments of each of its own requests, read as it forgets one."""
        forget = executor.forget

        def record(request_id: str, reason: str = "abort") -> None:
            req = executor.requests.get(request_id)  # still there: forget drops it
            timeline = executor.timelines.active.get(request_id)
            if req is not None and not req.guest and timeline and timeline.first_token_ns:
                self.stamp(request_id, "own", 1.0)
                self.stamp(request_id, "submitted", 1000 * req.arrival_time)
                self.stamp(request_id, "received", timeline.received_ns / 1e6)
                self.stamp(request_id, "scheduled", timeline.scheduled_ns / 1e6)
                self.stamp(request_id, "first_token", timeline.first_token_ns / 1e6)
            forget(request_id, reason)

        executor.forget = record  # type: ignore[method-assign]


def parts(taken: list[Taken]) -> dict[str, list[float]]:
    """Several services' ``take()`` joined: per part, one time per own request that every
    service on its way stamped."""
    moments: dict[str, dict[str, float]] = {}
    for t in taken:
        for request_id, seen in t["moments"].items():
            moments.setdefault(request_id, {}).update(seen)
    out: dict[str, list[float]] = {part: [] for part in WAIT_PARTS}
    for seen in moments.values():
        if "own" in seen and all(m in seen for _, a, b in LEGS for m in (a, b)):
            for part, start, end in LEGS:
                out[part].append(seen[end] - seen[start])
    out["gateway_ttft_ms"] = [ms for t in taken for ms in t["gateway_ttft_ms"]]
    return out
