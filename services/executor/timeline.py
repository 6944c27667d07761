"""Each request's life inside the executor as three spans and latency metrics.

    executor.queue    received -> the start of the step that first scheduled it
    executor.prefill  that step's start -> the end of the step that sampled its first token
                      (overlapped steps: of the call that read it back, the one after)
    executor.decode   first token -> finish (stop, length, abort, timeout)

Spans are started and ended with explicit timestamps taken around ``engine.step()``; nothing
is recorded per step except two counters, so tracing costs O(requests), not O(tokens). The
decode span's context travels to the detokenizer in ``StreamStart.trace``.
All methods run on the event-loop thread, between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from common.metrics import ExecutorMetrics
from common.telemetry import Attr, carrier
from gpu.engine import StepOutput

FAILED = ("abort", "timeout", "error")  # finish reasons that mark the open span as failed
HANDOFF = "handoff"  # a prefill executor's request, its KV written to its decode executor


@dataclass
class Timeline:
    request_id: str
    parent: Context  # the scheduler's span: parent of all three
    prompt_tokens: int
    received_ns: int
    queue: Span
    prefill: Span | None = None
    decode: Span | None = None
    scheduled_ns: int = 0
    first_token_ns: int = 0
    output_tokens: int = 0
    decode_steps: int = 0
    decode_batch_sum: int = 0
    # Disaggregated, on the decode executor: the prompt is computed by a prefill executor,
    # which counts its prompt tokens and observes its queue and prefill times; here the
    # spans alone record the wait (each request counted once across the mesh).
    remote_prefill: bool = False


class Timelines:
    def __init__(self, tracer: Tracer, metrics: ExecutorMetrics, executor_id: str) -> None:
        self.tracer = tracer
        self.metrics = metrics
        self.executor_id = executor_id
        self.active: dict[str, Timeline] = {}
        self.queued: dict[str, Timeline] = {}  # received, not scheduled yet

    def attributes(self, request_id: str, **extra: AttributeValue) -> dict[str, AttributeValue]:
        return {Attr.REQUEST_ID: request_id, Attr.EXECUTOR_ID: self.executor_id, **extra}

    def received(self, request_id: str, prompt_tokens: int) -> None:
        """Called in the submit handler, whose current context is the sender's span."""
        now = time.time_ns()
        parent = otel_context.get_current()
        queue = self.tracer.start_span(
            "executor.queue",
            context=parent,
            start_time=now,
            attributes=self.attributes(request_id, **{Attr.PROMPT_TOKENS: prompt_tokens}),
        )
        timeline = Timeline(request_id, parent, prompt_tokens, now, queue)
        self.active[request_id] = timeline
        self.queued[request_id] = timeline

    def stepped(
        self,
        started_ns: int,
        ended_ns: int,
        outputs: Sequence[StepOutput],
        admitted: Callable[[str], bool],
    ) -> None:
        """Account one step: who got scheduled, who got a first token, tokens produced."""
        for request_id in [rid for rid in self.queued if admitted(rid)]:
            self._scheduled(self.queued[request_id], started_ns)
        batch = len(outputs)
        generated = 0
        for out in outputs:
            if out.embedding is None:  # (an embedding's one token is not output: none counts)
                generated += len(out.new_token_ids)
            timeline = self.active.get(out.request_id)
            if timeline is None:
                continue
            timeline.output_tokens = out.output_tokens
            if timeline.decode is None:
                if timeline.prefill is None:  # scheduled and sampled in one step
                    self._scheduled(timeline, started_ns)
                self._first_token(timeline, ended_ns, batch, out.cached_tokens)
            else:
                timeline.decode_steps += 1
                timeline.decode_batch_sum += batch
        self.metrics.generation_tokens.inc(generated)

    def _scheduled(self, timeline: Timeline, at_ns: int) -> None:
        self.queued.pop(timeline.request_id, None)
        timeline.scheduled_ns = at_ns
        timeline.queue.end(end_time=at_ns)
        if not timeline.remote_prefill:
            self.metrics.queue_time.observe((at_ns - timeline.received_ns) / 1e9)
        timeline.prefill = self.tracer.start_span(
            "executor.prefill",
            context=timeline.parent,
            start_time=at_ns,
            attributes=self.attributes(
                timeline.request_id, **{Attr.PROMPT_TOKENS: timeline.prompt_tokens}
            ),
        )

    def _first_token(self, timeline: Timeline, at_ns: int, batch: int, cached: int) -> None:
        assert timeline.prefill is not None
        timeline.first_token_ns = at_ns
        timeline.prefill.set_attribute(Attr.CACHED_TOKENS, cached)
        timeline.prefill.set_attribute(Attr.BATCH_SIZE, batch)
        timeline.prefill.end(end_time=at_ns)
        if not timeline.remote_prefill:
            self.metrics.prefill_time.observe((at_ns - timeline.scheduled_ns) / 1e9)
            self.metrics.prompt_tokens.inc(timeline.prompt_tokens)
        timeline.decode = self.tracer.start_span(
            "executor.decode",
            context=timeline.parent,
            start_time=at_ns,
            attributes=self.attributes(timeline.request_id),
        )

    def prefilled_elsewhere(self, request_id: str, remote: bool = True) -> None:
        """``request_id``'s prompt is (``remote``) or, after a fall-back, is no longer
        computed by its prefill executor (``Timeline.remote_prefill``)."""
        timeline = self.active.get(request_id)
        if timeline is not None:
            timeline.remote_prefill = remote

    def context(self, request_id: str) -> Context | None:
        """The request's parent context here (the scheduler's span), to publish under."""
        timeline = self.active.get(request_id)
        return timeline.parent if timeline is not None else None

    def kv_transfer(
        self, request_id: str, peer: str, started_ns: int, ended_ns: int, num_bytes: int,
        pages: int, error: str = "",
    ) -> None:  # fmt: skip
        """The ``executor.kv_transfer`` span of a prompt's KV written to ``peer``."""
        timeline = self.active.get(request_id)
        extra: dict[str, AttributeValue] = {
            Attr.PEER: peer,
            Attr.KV_BYTES: num_bytes,
            Attr.KV_PAGES: pages,
            Attr.KV_MS: (ended_ns - started_ns) / 1e6,
        }
        span = self.tracer.start_span(
            "executor.kv_transfer",
            context=timeline.parent if timeline is not None else None,
            start_time=started_ns,
            attributes=self.attributes(request_id, **extra),
        )
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=ended_ns)

    def carrier(self, request_id: str) -> dict[str, str]:
        """The decode span's context, for the detokenizer's span (empty if unknown)."""
        timeline = self.active.get(request_id)
        if timeline is None or timeline.decode is None:
            return {}
        return carrier(timeline.decode)

    def finished(self, request_id: str, reason: str) -> None:
        """End whichever span is open; idempotent."""
        timeline = self.active.pop(request_id, None)
        if timeline is None:
            return
        self.queued.pop(request_id, None)
        now = time.time_ns()
        if timeline.decode is not None:
            span = timeline.decode
            span.set_attribute(Attr.OUTPUT_TOKENS, timeline.output_tokens)
            span.set_attribute(Attr.DECODE_STEPS, timeline.decode_steps)
            if timeline.decode_steps:
                span.set_attribute(
                    Attr.BATCH_SIZE, timeline.decode_batch_sum / timeline.decode_steps
                )
            if reason != HANDOFF:  # (a prompt handed to its decode executor decodes there)
                self.metrics.decode_time.observe((now - timeline.first_token_ns) / 1e9)
        elif timeline.prefill is not None:
            span = timeline.prefill
        else:
            span = timeline.queue
        span.set_attribute(Attr.FINISH_REASON, reason)
        if reason in FAILED:
            span.set_status(Status(StatusCode.ERROR, reason))
        span.end(end_time=now)
