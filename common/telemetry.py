"""Tracing: one OpenTelemetry tracer per service, OTLP export, W3C context in NATS headers.

A request is one trace across the mesh. Its context travels as ``traceparent`` (and
``tracestate``) in the NATS headers of every message published on its behalf
(``Service.publish`` injects the current context; ``Service.subscribe`` extracts it and runs
the handler inside it). Messages that batch many requests (an executor step's tokens) carry
one context per request in their body instead (``StreamStart.trace``), built by ``carrier``.

The span tree of one request (one per choice below the tokenizer, which fans ``n`` out):

    gateway.request                  gateway, the root (or a child of the client's traceparent)
    └─ tokenizer.encode              tokenizer
       └─ scheduler.route            scheduler: time in the global queue + the routing choice
          ├─ executor.queue          executor: received -> first scheduled
          ├─ executor.prefill        first scheduled -> first token
          └─ executor.decode         first token -> finish
             └─ detokenizer.stream   detokenizer: first token -> last text delta

Executor spans carry explicit start/end times taken from the step loop; nothing is a span per
step or per token.

Export is OTLP over HTTP/protobuf, configured the standard way: ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), ``OTEL_EXPORTER_OTLP_HEADERS``,
``OTEL_TRACES_SAMPLER``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SDK_DISABLED`` ... The
``--otlp-endpoint`` flag (``MESHSERVE_OTLP_ENDPOINT``) is the base URL, as the standard
endpoint variable is (``/v1/traces`` is appended). With neither, spans are still created (so
context keeps flowing through this service) but go nowhere. Each service has its own tracer
provider (no global state), so an in-process mesh still reports one ``service.name`` each.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("meshserve.telemetry")

PROPAGATOR = TraceContextTextMapPropagator()
SERVICE_NAME_PREFIX = "meshserve-"


class Attr:
    """Span attribute names (the ``gen_ai.*`` ones as vLLM's tracing spells them)."""

    REQUEST_ID = "gen_ai.request.id"
    MODEL = "gen_ai.request.model"
    MAX_TOKENS = "gen_ai.request.max_tokens"
    N = "gen_ai.request.n"
    PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    OUTPUT_TOKENS = "gen_ai.usage.completion_tokens"
    CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    FINISH_REASON = "gen_ai.response.finish_reasons"
    TTFT = "gen_ai.latency.time_to_first_token"
    E2E = "gen_ai.latency.e2e"
    EXECUTOR_ID = "meshserve.executor_id"
    BATCH_SIZE = "meshserve.batch_size"
    DECODE_STEPS = "meshserve.decode_steps"
    STREAM = "meshserve.stream"
    PRIORITY = "meshserve.priority"
    PROMPT_INDEX = "meshserve.prompt_index"  # a batched request's prompt (gateway.prompt)
    PEER = "meshserve.peer_executor_id"  # the other side of a KV transfer
    KV_BYTES = "meshserve.kv_transfer.bytes"
    KV_PAGES = "meshserve.kv_transfer.pages"
    KV_MS = "meshserve.kv_transfer.ms"
    HTTP_STATUS = "http.response.status_code"


def otlp_traces_endpoint(flag: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Where spans go: the flag's base URL, else the standard variables, else nowhere.

    Returns the full ``.../v1/traces`` URL, or None when export is off.
    """
    environ = os.environ if environ is None else environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    if flag:
        return flag.rstrip("/") + "/v1/traces"
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    if environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    return None


class Tracing:
    """A service's tracer provider and tracer; ``shutdown`` flushes what is still queued."""

    def __init__(
        self, service: str, instance_id: str, otlp_endpoint: str = "", region: str = ""
    ) -> None:
        self.service_name = SERVICE_NAME_PREFIX + service
        # Attributes given here win over OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME, so
        # every service keeps its own name even when the environment sets one for all.
        resource = Resource.create(
            {
                "service.name": self.service_name,
                "service.namespace": "meshserve",
                "service.instance.id": instance_id,
                # OpenTelemetry's semantic convention for where a process runs
                **({"cloud.region": region} if region else {}),
            }
        )
        self.endpoint = otlp_traces_endpoint(otlp_endpoint)
        self.provider = TracerProvider(
            resource=resource, shutdown_on_exit=self.endpoint is not None
        )
        if self.endpoint is not None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            protocol = os.environ.get(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            )
            if protocol != "http/protobuf":
                log.warning("OTLP protocol %r is not supported; using http/protobuf", protocol)
            exporter = OTLPSpanExporter(endpoint=self.endpoint)
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
            log.info("%s: exporting traces to %s", self.service_name, self.endpoint)
        self.tracer: Tracer = self.provider.get_tracer("meshserve")

    @property
    def exporting(self) -> bool:
        return self.endpoint is not None

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self.provider.shutdown()

    @contextmanager
    def handling(self, span_name: str | None, parent: Context, message: Any) -> Iterator[None]:
        """Run a message handler inside ``parent`` (the sender's context), in a span if named."""
        if span_name is None:
            token = otel_context.attach(parent)
            try:
                yield
            finally:
                otel_context.detach(token)
            return
        attributes = request_attributes(message)
        with self.tracer.start_as_current_span(
            span_name, context=parent, kind=SpanKind.CONSUMER, attributes=attributes
        ):
            yield


def request_attributes(message: Any) -> dict[str, Any]:
    request_id = getattr(message, "request_id", None)
    return {Attr.REQUEST_ID: request_id} if isinstance(request_id, str) else {}


def inject(headers: dict[str, str] | None, context: Context | None = None) -> dict[str, str] | None:
    """``headers`` plus the W3C trace context of ``context`` (default: the current one)."""
    carrier = dict(headers or {})
    PROPAGATOR.inject(carrier, context=context)
    return carrier or None


def extract(headers: Mapping[str, str] | None) -> Context:
    """The sender's context from NATS or HTTP headers (empty when there is none).

    HTTP headers are passed as they are: their ``get`` is case-insensitive."""
    return PROPAGATOR.extract(headers if headers is not None else {}, context=Context())


def carrier(span: Span) -> dict[str, str]:
    """``span``'s context as W3C headers, for messages that carry many requests' contexts."""
    headers: dict[str, str] = {}
    PROPAGATOR.inject(headers, context=trace.set_span_in_context(span, Context()))
    return headers


def end_with_error(span: Span, message: str, end_time: int | None = None) -> None:
    span.set_status(Status(StatusCode.ERROR, message))
    span.end(end_time=end_time)


def trace_id_hex(span: Span) -> str | None:
    """The span's trace id as Jaeger shows it, or None when it is not sampled."""
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return f"{ctx.trace_id:032x}"
