"""Prometheus metrics: every metric name of the mesh, one registry per service, ``/metrics``.

Names follow vLLM's (``vllm:time_to_first_token_seconds`` -> ``meshserve:...``) so dashboards
written for vLLM map by swapping the prefix. Where each is measured:

- gateway (label ``model_name``): what the client experiences - time to first token,
  inter-token latency (between text deltas the client receives), time per output token,
  end-to-end latency, prompt/generation length per request, successes by finish reason.
- scheduler: its global queue (size, time in it), requests routed per executor, rejections.
- executor (label ``executor_id``): engine state read at scrape time (running, waiting, KV
  usage, prefix-cache queries/hits), token throughput, time in the executor's queue, prefill
  and decode time, speculative-decoding drafts/acceptances.
- every service (label ``service``): messages handled and how long handlers took, error
  replies by status, and the process (CPU, memory, GC).

Counters are exposed with the ``_total`` suffix (``meshserve:prompt_tokens_total``), as vLLM's
are. Each service has its own ``CollectorRegistry`` (no global state; an in-process mesh holds
several). The gateway serves ``/metrics`` on its HTTP port; every other service on
``--metrics-port`` with ``/health`` beside it (``MetricsServer``). A scraper that accepts
OpenMetrics gets exemplars: the trace id of a sampled request on the gateway's latency
histograms, so a slow bucket in Grafana links to its trace in Jaeger.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import ALLOWUTF8
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector

log = logging.getLogger("meshserve.metrics")

PREFIX = "meshserve:"

# Buckets as vLLM's, with finer low ends: a small model on a big GPU decodes in ~2 ms.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
QUEUE_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
HANDLER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


def counter_total(counter: Counter) -> float:
    """A counter's value summed over its labels (benchmarks and tests read totals so)."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def new_registry() -> CollectorRegistry:
    """A service's registry, with the process's CPU, memory, file and GC metrics."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def exposition(registry: CollectorRegistry, accept: str) -> tuple[bytes, str]:
    """The registry as the scraper asked: OpenMetrics (with exemplars) or Prometheus text."""
    if "application/openmetrics-text" in accept:
        # The default escaping rewrites ':' to '_' in sample names but not in the TYPE line,
        # which scrapers reject; names with ':' are valid as they are.
        body = openmetrics_latest(registry, escaping=ALLOWUTF8)  # type: ignore[no-untyped-call]
        return body, OPENMETRICS_TYPE
    return generate_latest(registry), CONTENT_TYPE_LATEST


def metrics_handler(
    registry: CollectorRegistry,
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        body, content_type = exposition(registry, request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": content_type})

    return handle


class MetricsServer:
    """``/metrics`` and ``/health`` on their own port, for services without an HTTP API.

    ``/health`` answers 200 while ``problem()`` returns None and 503 with the reason
    otherwise (compose health checks and orchestrators probe it).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        problem: Callable[[], str | None],
        host: str = "0.0.0.0",
        port: int = 0,
    ) -> None:
        self.host = host
        self.requested_port = port
        self.problem = problem
        self.app = web.Application()
        self.app.router.add_get("/metrics", metrics_handler(registry))
        self.app.router.add_get("/health", self.health)
        self._runner: web.AppRunner | None = None

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        if self._runner is None:
            raise RuntimeError("metrics server not started")
        return int(self._runner.addresses[0][1])

    async def health(self, request: web.Request) -> web.Response:
        problem = self.problem()
        if problem is not None:
            return web.json_response({"status": "unavailable", "reason": problem}, status=503)
        return web.json_response({"status": "ok"})

    async def start(self) -> None:
        runner = web.AppRunner(self.app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.requested_port).start()
        except OSError as exc:
            await runner.cleanup()
            # One line the supervisor's log shows instead of a traceback.
            where = f"{self.host}:{self.requested_port}"
            raise SystemExit(f"cannot serve /metrics on {where}: {exc.strerror}") from None
        self._runner = runner
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class CallbackCollector(Collector):
    """Metrics whose values are read from live state at scrape time (no bookkeeping)."""

    def __init__(self, read: Callable[[], Iterable[Metric]]) -> None:
        self.read = read

    def collect(self) -> Iterable[Metric]:
        try:
            return list(self.read())
        except Exception:  # a scrape must not fail because a state read raced a change
            log.exception("metrics: reading live state failed")
            return []


# --- every service (the runtime) ---------------------------------------------------------------


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry, service: str, region: str = "") -> None:
        if region:  # where this process runs, for dashboards to group by (PromQL join)
            Info(
                PREFIX + "region",
                "The region (NATS cluster of the supercluster) this service runs in.",
                registry=registry,
            ).info({"region": region, "service": service})
        self.messages = Counter(
            PREFIX + "messages_handled",
            "Messages decoded and handled, by message type.",
            ["service", "message"],
            registry=registry,
        )
        self.handling = Histogram(
            PREFIX + "message_handling_seconds",
            "Time a handler took for one message, by message type.",
            ["service", "message"],
            buckets=HANDLER_BUCKETS,
            registry=registry,
        )
        self.error_replies = Counter(
            PREFIX + "error_replies",
            "Requests this service failed with an error reply, by HTTP-style status.",
            ["service", "status"],
            registry=registry,
        )
        self.service = service
        self._children: dict[str, tuple[Counter, Histogram]] = {}

    def handled(self, message: str, seconds: float) -> None:
        children = self._children.get(message)
        if children is None:  # labels() locks and looks up; once per message type is enough
            children = (
                self.messages.labels(self.service, message),
                self.handling.labels(self.service, message),
            )
            self._children[message] = children
        children[0].inc()
        children[1].observe(seconds)

    def error_reply(self, status: int) -> None:
        self.error_replies.labels(self.service, str(status)).inc()


# --- gateway -----------------------------------------------------------------------------------


class GatewayMetrics:
    """Latency as the client sees it, per choice (a request with ``n`` choices counts n)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=registry)

        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Time from the request's arrival to its first text delta.",
            TTFT_BUCKETS,
        ).labels(model_name)
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between consecutive text deltas of a request (one per executor step).",
            TOKEN_LATENCY_BUCKETS,
        ).labels(model_name)
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Mean time per output token after the first: (e2e - ttft) / (tokens - 1).",
            TOKEN_LATENCY_BUCKETS,
        ).labels(model_name)
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Time from the request's arrival to its last text delta.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", TOKEN_COUNT_BUCKETS
        ).labels(model_name)
        self.generation_tokens = histogram(
            "request_generation_tokens",
            "Output length of finished requests.",
            TOKEN_COUNT_BUCKETS,
        ).labels(model_name)
        # Both count choices (each of a request's n): a choice ends once, as a success (its
        # finish reason, "abort" when its client left first, as vLLM counts those) or a failure.
        self.success = Counter(
            PREFIX + "request_success",
            "Choices (each of a request's n) that finished, by finish reason; abort: the "
            "client left first.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.failure = Counter(
            PREFIX + "request_failure",
            "Choices (each of a request's n) that failed after the request was accepted, by "
            "HTTP status.",
            ["model_name", "status"],
            registry=registry,
        )
        self.resumed = Counter(
            PREFIX + "requests_resumed",
            "Choices resumed as a continuation after their tokens were lost in transit, by "
            "the error code that found the loss.",
            ["model_name", "reason"],
            registry=registry,
        )
        self.model_name = model_name

    def finished(self, reason: str, choices: int = 1) -> None:
        self.success.labels(self.model_name, reason).inc(choices)

    def resumed_after(self, reason: str) -> None:
        self.resumed.labels(self.model_name, reason).inc()

    def failed(self, status: int, choices: int = 1) -> None:
        self.failure.labels(self.model_name, str(status)).inc(choices)


# --- scheduler ---------------------------------------------------------------------------------


class DetokenizerMetrics:
    def __init__(self, registry: CollectorRegistry, streams: Callable[[], int]) -> None:
        def read() -> Iterable[Metric]:
            yield GaugeMetricFamily(
                PREFIX + "detokenizer_streams",
                "Streams this detokenizer shard holds state for (0 when the mesh is idle).",
                value=streams(),
            )

        registry.register(CallbackCollector(read))


class SchedulerMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        queue_size: Callable[[], int],
        inflight: Callable[[], int] = lambda: 0,
    ) -> None:
        def read() -> Iterable[Metric]:
            yield GaugeMetricFamily(
                PREFIX + "scheduler_queue_size",
                "Requests waiting in the scheduler's global queue for an executor with room.",
                value=queue_size(),
            )
            yield GaugeMetricFamily(
                PREFIX + "scheduler_inflight_requests",
                "Requests routed to an executor that has not finished them yet.",
                value=inflight(),
            )

        registry.register(CallbackCollector(read))
        self.queue_time = Histogram(
            PREFIX + "scheduler_queue_time_seconds",
            "Time a request waited in the scheduler's queue before it was routed.",
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.routed = Counter(
            PREFIX + "scheduler_requests_routed",
            "Requests sent to each executor.",
            ["executor_id"],
            registry=registry,
        )
        self.rejected = Counter(
            PREFIX + "scheduler_requests_rejected",
            "Requests refused with 429 because the queue was full.",
            registry=registry,
        )
        self.migrated = Counter(
            PREFIX + "scheduler_requests_migrated",
            "Requests moved off a lost executor to continue on another.",
            registry=registry,
        )
        self.executor_failed = Counter(
            PREFIX + "scheduler_requests_failed_executor_lost",
            "Requests failed because their executor was lost and they could not be moved.",
            registry=registry,
        )


# --- executor ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSnapshot:
    """What the executor's engine holds right now (cumulative counts since start)."""

    running: int
    waiting: int
    kv_cache_usage: float  # 0..1, as vLLM's kv_cache_usage_perc
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found there
    spec_drafts: int = 0  # sequence-steps that verified a draft
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # of which accepted
    spec_accepted_per_pos: tuple[int, ...] = ()  # [j]: drafts whose token j was accepted
    spec_emitted_tokens: int = 0  # tokens the verifying steps gave clients, after stop cuts
    forward_passes: int = 0  # steps that ran the target model (prefill chunks included)
    tensor_parallel_size: int = 1  # ranks the replica is split across
    collective_seconds: float = 0.0  # rank 0's time in tensor-parallel collectives
    preempted_for_pages: int = 0  # sequences preempted (recomputed later): no KV page left
    guests_yielded: int = 0  # guests preempted for a waiting request of the region's own
    overlapped_steps: bool = False  # the engine queues each step before reading the last
    overlap_dropped_rows: int = 0  # rows a step ran for a sequence the last token had ended


class ExecutorMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        executor_id: str,
        snapshot: Callable[[], EngineSnapshot],
    ) -> None:
        labels = ["executor_id"]

        def read() -> Iterable[Metric]:
            s = snapshot()
            gauges = (
                ("num_requests_running", "Requests in the engine's running batch.", s.running),
                ("num_requests_waiting", "Requests waiting for the engine.", s.waiting),
                ("kv_cache_usage_perc", "Fraction of KV pages in use (0..1).", s.kv_cache_usage),
                ("tensor_parallel_size", "Ranks (devices) the model replica is split across.",
                 s.tensor_parallel_size),
                ("engine_overlapped_steps",
                 "1 where the engine queues each step before reading the last one's tokens.",
                 int(s.overlapped_steps)),
            )  # fmt: skip
            for name, doc, value in gauges:
                gauge = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
                gauge.add_metric([executor_id], value)
                yield gauge
            counters = (
                ("prefix_cache_queries", "Prompt tokens looked up.", s.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens found in the cache.", s.prefix_cache_hits),
                ("spec_decode_num_drafts", "Drafts verified (per sequence-step).", s.spec_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Drafts accepted.", s.spec_accepted_tokens),
                ("spec_decode_num_emitted_tokens",
                 "Tokens the verifying steps emitted (after stop and length cuts).",
                 s.spec_emitted_tokens),
                ("engine_forward_passes", "Steps that ran the target model.", s.forward_passes),
                ("engine_overlap_dropped_rows",
                 "Rows an overlapped step ran for a sequence the step before had ended (a stop "
                 "token): the overlap's cost.", s.overlap_dropped_rows),
                ("tensor_parallel_collective_seconds",
                 "Time rank 0 spent in tensor-parallel collectives (waits for the other ranks "
                 "included): what the split costs.", s.collective_seconds),
            )  # fmt: skip
            for name, doc, value in counters:
                counter = CounterMetricFamily(PREFIX + name, doc, labels=labels)
                counter.add_metric([executor_id], value)
                yield counter
            per_pos = CounterMetricFamily(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Drafts whose token at this position was accepted.",
                labels=[*labels, "position"],
            )
            for position, value in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([executor_id, str(position)], value)
            yield per_pos
            preemptions = CounterMetricFamily(
                PREFIX + "num_preemptions",
                "Sequences preempted and recomputed later, by why: no KV page left "
                "(kv_cache_full), or a guest yielding its slot to a request of this region's "
                "own clients (guest_yield).",
                labels=[*labels, "reason"],
            )
            preemptions.add_metric([executor_id, "kv_cache_full"], s.preempted_for_pages)
            preemptions.add_metric([executor_id, "guest_yield"], s.guests_yielded)
            yield preemptions

        registry.register(CallbackCollector(read))

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=registry)

        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of requests prefilled (cached ones included)."
        ).labels(executor_id)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(
            executor_id
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time from the executor receiving a request to its first scheduled step.",
            QUEUE_BUCKETS,
        ).labels(executor_id)
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Time from a request's first scheduled step to its first token.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(executor_id)
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "Time from a request's first token to its last.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(executor_id)
        # Disaggregated prefill: KV written from this (prefill) executor to a decode one.
        pair = [*labels, "peer_executor_id"]
        self.kv_transfer_bytes = Counter(
            PREFIX + "kv_transfer_bytes", "KV bytes written to a decode executor.", pair,
            registry=registry,
        )  # fmt: skip
        self.kv_transfer_time = Histogram(
            PREFIX + "kv_transfer_time_seconds", "Time of one request's KV transfer.", pair,
            buckets=KV_TRANSFER_BUCKETS, registry=registry,
        )  # fmt: skip
        self.kv_transfer_failures = Counter(
            PREFIX + "kv_transfer_failures",
            "Prompts a decode executor computed itself because their handoff from the prefill "
            "executor failed (a failed or late KV write, a silent peer); counted there, once.",
            pair, registry=registry,
        )  # fmt: skip


def all_metric_names() -> set[str]:
    """Every ``meshserve:`` series name the services expose (dashboards are checked against
    it): counters with ``_total``, histograms as their base name."""
    registry = CollectorRegistry()
    ServiceMetrics(registry, "x")
    GatewayMetrics(registry, "x")
    SchedulerMetrics(registry, lambda: 0)
    DetokenizerMetrics(registry, lambda: 0)
    ExecutorMetrics(registry, "x", lambda: EngineSnapshot(0, 0, 0.0, 0, 0))
    names = set()
    for metric in registry.collect():
        suffix = "_total" if metric.type == "counter" else ""
        names.add(metric.name + suffix)
    return {n for n in names if n.startswith(PREFIX)}
