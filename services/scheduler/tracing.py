"""The scheduler's ``scheduler.route`` spans and queue-time metrics, per request it holds.

A request's span opens when it enters the global queue (inside the submit handler, so its
parent is the tokenizer's span) and ends when it is routed to an executor, dropped (aborted,
expired) or rejected. Dispatch runs from many triggers (a submit, a heartbeat, the sweep), so
the span is made current explicitly with ``use`` around the work done for that request
(asking the index, publishing to the executor): the executor's spans become its children.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from common.metrics import SchedulerMetrics
from common.telemetry import Attr
from common.wire.executor import TokenizedRequest


@dataclass
class Route:
    span: Span
    parent: Context
    queued_at: float  # monotonic


class RouteTraces:
    def __init__(self, tracer: Tracer, metrics: SchedulerMetrics) -> None:
        self.tracer = tracer
        self.metrics = metrics
        self.open: dict[str, Route] = {}

    def queued(self, req: TokenizedRequest, parent: Context | None = None) -> None:
        """A request entered the queue: in its submit handler, or again after its executor
        died (then ``parent``, what ``routed`` returned, continues the request's trace)."""
        retry = parent is not None
        parent = parent or otel_context.get_current()
        span = self.tracer.start_span(
            "scheduler.route",
            context=parent,
            attributes={
                Attr.REQUEST_ID: req.request_id,
                Attr.PROMPT_TOKENS: len(req.prompt_token_ids),
                Attr.PRIORITY: req.priority,
                "meshserve.retry": retry,
            },
        )
        self.open[req.request_id] = Route(span, parent, time.monotonic())

    @contextmanager
    def use(self, request_id: str) -> Iterator[None]:
        """Make the request's span current (publishes and index queries become its children)."""
        route = self.open.get(request_id)
        if route is None:
            yield
            return
        with trace.use_span(route.span, end_on_exit=False):
            yield

    def routed(self, request_id: str, executor_id: str) -> Context | None:
        """End the request's span; return its parent context, which the scheduler keeps with
        the request while an executor holds it (a re-route continues the same trace)."""
        route = self.open.pop(request_id, None)
        self.metrics.routed.labels(executor_id).inc()
        if route is None:
            return None
        self.metrics.queue_time.observe(time.monotonic() - route.queued_at)
        route.span.set_attribute(Attr.EXECUTOR_ID, executor_id)
        route.span.end()
        return route.parent

    def dropped(self, request_id: str, reason: str) -> None:
        """The request left the queue without an executor (aborted, expired)."""
        route = self.open.pop(request_id, None)
        if route is not None:
            route.span.set_attribute(Attr.FINISH_REASON, reason)
            route.span.set_status(Status(StatusCode.ERROR, reason))
            route.span.end()
