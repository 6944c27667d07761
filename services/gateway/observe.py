"""Where the client's latency is measured: the root span and the per-request observer.

``request_span`` opens ``gateway.request``, the root of the request's trace (or a child of the
client's own ``traceparent``), around everything the HTTP request causes. ``RequestObserver``
is fed every text delta as the handler takes it from the stream, i.e. when it is written to
the client, and records per choice:

- time to first token: arrival -> first text delta
- inter-token latency: between consecutive text deltas (one per executor step; a delta that
  the detokenizer held back, e.g. half a UTF-8 character, merges two steps)
- time per output token: (last delta - first delta) / (completion tokens - 1), when > 1 token
- end-to-end latency: arrival -> last delta, plus prompt/generation lengths and the finish
  reason, and the request's totals as attributes of the root span.

Of the client's headers only the W3C trace context is read (``trace_headers``), and of that
only ``tracestate`` travels on verbatim: the span context keeps it, so it is copied into the
NATS headers of every message of the request, at every hop. It is therefore trimmed to W3C's
512 characters here, never a reason to fail the request; ``traceparent`` is not copied (each
hop writes its own, 55 characters) and one longer than ``MAX_TRACEPARENT_CHARS`` is ignored.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from common.metrics import GatewayMetrics
from common.runtime import RequestError
from common.telemetry import Attr, extract, trace_id_hex
from common.wire.gateway import TextDelta
from services.gateway.responses import scored_only

# W3C Trace Context: a tracestate holds at most 32 members, and a vendor that must shorten one
# keeps at least 512 characters, dropping members over 128 characters first, then members from
# the end (the oldest). OpenTelemetry itself would keep up to 8192 characters.
MAX_TRACESTATE_CHARS = 512
MAX_TRACESTATE_MEMBERS = 32
LONG_TRACESTATE_MEMBER = 128
# Version 00 is 55 characters; later versions may append fields. Only its ids are read (each
# hop writes a traceparent of its own), so this only bounds the parsing, as OpenTelemetry does.
MAX_TRACEPARENT_CHARS = 512


def trim_tracestate(fields: Sequence[str]) -> str | None:
    """One tracestate from the header's fields (joined with "," as RFC 9110 says), cut to the
    W3C limits; None when nothing is left. The members are not validated here: OpenTelemetry
    discards a tracestate with any malformed member (non-ASCII ones included, so nothing that
    NATS headers cannot carry gets through)."""
    members = [m.strip(" \t") for f in fields for m in f.split(",")]
    members = [m for m in members if m][:MAX_TRACESTATE_MEMBERS]

    def length() -> int:
        return sum(len(m) for m in members) + max(len(members) - 1, 0)

    for i in reversed(range(len(members))):
        if length() <= MAX_TRACESTATE_CHARS:
            break
        if len(members[i]) > LONG_TRACESTATE_MEMBER:
            del members[i]
    while length() > MAX_TRACESTATE_CHARS:
        members.pop()
    return ",".join(members) or None


def trace_headers(http_headers: Mapping[str, str]) -> dict[str, str]:
    """The client's W3C trace context, bounded; the only headers the mesh ever sees."""
    headers: dict[str, str] = {}
    traceparent = http_headers.get("traceparent")
    if traceparent is None or len(traceparent) > MAX_TRACEPARENT_CHARS:
        return headers  # no parent: a tracestate alone is ignored, as OpenTelemetry does
    headers["traceparent"] = traceparent
    getall = getattr(http_headers, "getall", None)  # aiohttp: a header may repeat
    fields = getall("tracestate", []) if getall else [http_headers.get("tracestate") or ""]
    tracestate = trim_tracestate(fields)
    if tracestate is not None:
        headers["tracestate"] = tracestate
    return headers


@contextmanager
def request_span(tracer: Tracer, http_headers: Mapping[str, str], route: str) -> Iterator[Span]:
    with tracer.start_as_current_span(
        "gateway.request",
        context=extract(trace_headers(http_headers)),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": "POST", "http.route": route},
    ) as span:
        try:
            yield span
        except RequestError as exc:
            span.set_attribute(Attr.HTTP_STATUS, exc.status)
            raise


class RequestObserver:
    """A request's metrics and span attributes. Each of its ``n`` choices is counted once:
    finished (its reason), failed with the request, or aborted when the client left."""

    def __init__(
        self, metrics: GatewayMetrics, span: Span, n: int = 1, prompt_only: bool = False
    ) -> None:
        self.metrics = metrics
        self.span = span
        self.n = n
        # max_tokens 0 with echo, an embedding: the one token generated is not the client's
        # (the response says "length" and 0 completion tokens; so do the metrics)
        self.prompt_only = prompt_only
        self.ended = False  # failed or left: the choices still open were counted then
        self.started = time.perf_counter()
        trace_id = trace_id_hex(span)
        self.exemplar = {"trace_id": trace_id} if trace_id else None
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.cached_tokens = 0
        self.finish_reasons: list[str] = []

    def delta(self, index: int, delta: TextDelta) -> None:
        now = time.perf_counter()
        if index not in self.first:
            self.first[index] = now
            ttft = now - self.started
            self.metrics.ttft.observe(ttft, self.exemplar)
            if index == 0:
                self.span.set_attribute(Attr.TTFT, ttft)
        else:
            self.metrics.itl.observe(now - self.last[index])
        self.last[index] = now
        if delta.finish_reason is not None:
            self.finished(index, delta, now)

    def finished(self, index: int, delta: TextDelta, now: float) -> None:
        if self.prompt_only:
            delta = scored_only(delta)
        assert delta.finish_reason is not None
        self.metrics.e2e.observe(now - self.started, self.exemplar)
        self.metrics.finished(delta.finish_reason)
        self.finish_reasons.append(delta.finish_reason)
        if delta.usage is not None:
            tokens = delta.usage.completion_tokens
            self.metrics.prompt_tokens.observe(delta.usage.prompt_tokens)
            self.metrics.generation_tokens.observe(tokens)
            if tokens > 1:
                self.metrics.tpot.observe((now - self.first[index]) / (tokens - 1))
            # the choices share the prompt: counted once, as the response's usage counts it
            self.prompt_tokens = max(self.prompt_tokens, delta.usage.prompt_tokens)
            self.output_tokens += tokens
            self.cached_tokens = max(self.cached_tokens, delta.usage.cached_tokens)
        self.span.set_attributes(
            {
                Attr.PROMPT_TOKENS: self.prompt_tokens,
                Attr.OUTPUT_TOKENS: self.output_tokens,
                Attr.CACHED_TOKENS: self.cached_tokens,
                Attr.FINISH_REASON: self.finish_reasons,
                Attr.E2E: now - self.started,
            }
        )

    def left(self, failure: str | None) -> None:
        """The request ends with choices open and no failure counted: its client left (or
        the gateway shuts down), "abort" as vLLM counts those; a failure of the gateway's own
        (``failure``: a 500) counts as one."""
        if not self.ended and self.open_choices:
            if failure is None:
                self.metrics.finished("abort", self.open_choices)
            else:
                self.metrics.failed(500, self.open_choices)
        self.ended = True

    def resumed(self, index: int, reason: str, delivered: int, attempt: int) -> None:
        """Choice ``index`` lost tokens in transit and goes on as a continuation."""
        self.metrics.resumed_after(reason)
        self.span.add_event(
            "request.resumed",
            {
                "meshserve.choice": index,
                "meshserve.resume.reason": reason,
                "meshserve.resume.attempt": attempt,
                "meshserve.resume.delivered_tokens": delivered,
            },
        )

    @property
    def open_choices(self) -> int:
        return self.n - len(self.finish_reasons)

    def failed(self, error: RequestError) -> None:
        """A stage failed the request (or it timed out) after it entered the mesh: every
        choice still open fails with it."""
        if not self.ended and self.open_choices:
            self.metrics.failed(error.status, self.open_choices)
        self.ended = True
        self.span.set_attribute("error.type", error.code or error.type)
        self.span.set_status(Status(StatusCode.ERROR, str(error)))
