"""Tracing and metrics through a real mesh: a real OTLP receiver, real /metrics scrapes.

One trace per request holds a span from every service, linked parent to child:

    gateway.request -> tokenizer.encode -> scheduler.route -> executor.{queue,prefill,decode}
                                                            executor.decode -> detokenizer.stream
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common import settings
from common.config import MeshConfig
from common.runtime import Service
from common.telemetry import otlp_traces_endpoint
from tests.mesh import MeshHarness, openai_client
from tools.bench.otlp_receiver import OtlpReceiver, ReceivedSpan

MAX_TOKENS = 5
SPANS = {
    # span name: (service.name, parent span name or None for the root)
    "gateway.request": ("meshserve-gateway", None),
    "tokenizer.encode": ("meshserve-tokenizer", "gateway.request"),
    "scheduler.route": ("meshserve-scheduler", "tokenizer.encode"),
    "executor.queue": ("meshserve-executor", "scheduler.route"),
    "executor.prefill": ("meshserve-executor", "scheduler.route"),
    "executor.decode": ("meshserve-executor", "scheduler.route"),
    "detokenizer.stream": ("meshserve-detokenizer", "executor.decode"),
}


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def mesh(tiny_llama, receiver):
    harness = MeshHarness(
        tiny_llama,
        executors=2,
        kv_cache_tokens=2048,
        otlp_endpoint=receiver.endpoint,
        serve_metrics=True,
    ).start()
    yield harness
    harness.stop()


def runtimes(mesh: MeshHarness) -> list[Service]:
    return [svc.mesh.service if hasattr(svc, "mesh") else svc.svc for svc in mesh.services]


def flush_all(mesh: MeshHarness) -> None:
    for runtime in runtimes(mesh):
        runtime.tracing.flush(5)


@pytest.fixture
async def client(mesh):
    async with openai_client(mesh.base_url) as c:
        yield c


async def send(client, i: int) -> tuple[str, int, int]:
    """One request (they alternate completion/chat, streamed or not).

    Returns (response id, prompt tokens, completion tokens)."""
    common = dict(
        model="tiny",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chat = i % 2 == 1
    stream = i % 3 != 0
    if chat:
        messages = [{"role": "user", "content": f"Tell me about request {i}"}]
        if not stream:
            r = await client.chat.completions.create(messages=messages, **common)
            return r.id, r.usage.prompt_tokens, r.usage.completion_tokens
        chunks = [
            c
            async for c in await client.chat.completions.create(
                messages=messages, stream=True, stream_options={"include_usage": True}, **common
            )
        ]
    else:
        prompt = f"The quick brown fox number {i}"
        if not stream:
            r = await client.completions.create(prompt=prompt, **common)
            return r.id, r.usage.prompt_tokens, r.usage.completion_tokens
        chunks = [
            c
            async for c in await client.completions.create(
                prompt=prompt, stream=True, stream_options={"include_usage": True}, **common
            )
        ]
    usage = chunks[-1].usage
    return chunks[0].id, usage.prompt_tokens, usage.completion_tokens


def traces_by_request(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    """Each root span's request id -> every span of its trace."""
    by_trace: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace_id].append(span)
    result = {}
    for span in spans:
        if span.name == "gateway.request":
            result[span.attributes["gen_ai.request.id"]] = by_trace[span.trace_id]
    return result


def complete(trace: list[ReceivedSpan]) -> bool:
    return set(SPANS) <= {s.name for s in trace}


async def test_one_trace_per_request_spans_every_service(mesh, receiver, client):
    results = await asyncio.gather(*(send(client, i) for i in range(4)))
    ids = [rid for rid, _, _ in results]

    def all_complete(spans):
        traces = traces_by_request(spans)
        return all(rid in traces and complete(traces[rid]) for rid in ids)

    assert await asyncio.to_thread(receiver.wait_for, all_complete, 20, lambda: flush_all(mesh))
    traces = traces_by_request(receiver.snapshot())
    assert len({traces[rid][0].trace_id for rid in ids}) == len(ids)  # one trace each

    for rid, prompt_tokens, completion_tokens in results:
        trace = traces[rid]
        names = Counter(s.name for s in trace)
        assert all(names[name] == 1 for name in SPANS), names
        by_name = {s.name: s for s in trace}
        by_id = {s.span_id: s for s in trace}
        for name, (service, parent) in SPANS.items():
            span = by_name[name]
            assert span.service == service, (name, span.service)
            if parent is None:
                assert span.parent_id is None
            else:
                assert span.parent_id in by_id, f"{name} has a parent outside the trace"
                assert by_id[span.parent_id].name == parent, (name, by_id[span.parent_id].name)
            # every span names its request (the gateway's id; choices append "-<index>")
            assert span.attributes["gen_ai.request.id"] in (rid, f"{rid}-0")
            assert span.status_code != 2, f"{name} ended with an error"  # 2: STATUS_CODE_ERROR

        root = by_name["gateway.request"]
        assert root.attributes["gen_ai.usage.prompt_tokens"] == prompt_tokens
        assert root.attributes["gen_ai.usage.completion_tokens"] == completion_tokens
        queue, prefill, decode = (by_name[f"executor.{p}"] for p in ("queue", "prefill", "decode"))
        executor_ids = {s.attributes["meshserve.executor_id"] for s in (queue, prefill, decode)}
        assert len(executor_ids) == 1 and executor_ids <= {"executor-0", "executor-1"}
        assert by_name["scheduler.route"].attributes["meshserve.executor_id"] in executor_ids
        assert prefill.attributes["gen_ai.usage.prompt_tokens"] == prompt_tokens
        assert prefill.attributes["meshserve.batch_size"] >= 1
        assert "gen_ai.usage.cached_tokens" in prefill.attributes
        assert decode.attributes["gen_ai.usage.completion_tokens"] == completion_tokens
        assert decode.attributes["gen_ai.response.finish_reasons"] == "length"
        assert by_name["detokenizer.stream"].attributes["gen_ai.usage.completion_tokens"] == (
            completion_tokens
        )
        # the executor's phases tile its time with the request, inside the root span
        assert queue.end_ns == prefill.start_ns and prefill.end_ns == decode.start_ns
        assert queue.start_ns <= queue.end_ns <= prefill.end_ns
        assert root.start_ns <= queue.start_ns <= decode.end_ns <= root.end_ns


async def test_a_batch_has_a_span_per_prompt_with_its_own_values(mesh, receiver, client):
    """Batched prompts: each prompt's gateway.prompt (its tokens, TTFT and finish) under the
    one gateway.request, and its own tokenizer.encode under it, where the prompts' values all
    landed on the root before (the last one written won)."""
    prompts = ["One", "A much longer prompt than the first of the two, with more tokens"]
    response = await client.completions.create(
        model="tiny", prompt=prompts, max_tokens=MAX_TOKENS, temperature=0
    )
    rid = response.id

    def whole(spans: list[ReceivedSpan]) -> bool:
        trace = traces_by_request(spans).get(rid, [])
        return Counter(s.name for s in trace)["detokenizer.stream"] == 2

    assert await asyncio.to_thread(receiver.wait_for, whole, 20, lambda: flush_all(mesh))
    trace = traces_by_request(receiver.snapshot())[rid]
    root = next(s for s in trace if s.name == "gateway.request")
    spans = sorted(
        (s for s in trace if s.name == "gateway.prompt"),
        key=lambda s: s.attributes["meshserve.prompt_index"],
    )
    assert [s.parent_id for s in spans] == [root.span_id] * 2
    lengths = [s.attributes["gen_ai.usage.prompt_tokens"] for s in spans]
    assert lengths[0] < lengths[1]
    assert sum(lengths) == response.usage.prompt_tokens
    for k, span in enumerate(spans):
        assert span.attributes["gen_ai.request.id"] == f"{rid}-{k}"
        assert span.attributes["gen_ai.latency.time_to_first_token"] > 0
        assert root.start_ns <= span.start_ns <= span.end_ns <= root.end_ns
        encode = [s for s in trace if s.name == "tokenizer.encode" and s.parent_id == span.span_id]
        assert len(encode) == 1 and encode[0].parent_id == span.span_id
    assert root.attributes["gen_ai.request.n"] == 2


Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, labels) -> value


def samples(text: str) -> Scrape:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(scrape: Scrape, name: str, **labels: str) -> float:
    """Sum of a series over every label set that includes ``labels``."""
    return sum(
        (
            value
            for (n, lbls), value in scrape.items()
            if n == name and set(labels.items()) <= set(lbls)
        ),
        0.0,
    )


async def scrape(session: aiohttp.ClientSession, url: str) -> Scrape:
    async with session.get(url) as resp:
        assert resp.status == 200
        return samples(await resp.text())


async def scrape_all(mesh: MeshHarness) -> dict[str, Scrape]:
    """The gateway on its HTTP port, every other service on its metrics port, summed by
    service kind (several executors add up)."""
    urls = {"gateway": [f"http://127.0.0.1:{mesh.port}/metrics"]}
    for runtime in runtimes(mesh):
        if runtime.name != "gateway":
            assert runtime.metrics_server is not None
            url = f"http://127.0.0.1:{runtime.metrics_server.port}/metrics"
            urls.setdefault(runtime.name, []).append(url)
    result: dict[str, Scrape] = {}
    async with aiohttp.ClientSession() as session:
        for kind, kind_urls in urls.items():
            merged: Scrape = defaultdict(float)
            for url in kind_urls:
                for key, value in (await scrape(session, url)).items():
                    merged[key] += value
            result[kind] = merged
    return result


async def test_metrics_count_every_request(mesh, client):
    n = 5
    before = await scrape_all(mesh)
    results = await asyncio.gather(*(send(client, i) for i in range(n)))
    await asyncio.sleep(0.3)  # the gateway records a request as its last delta is taken
    after = await scrape_all(mesh)

    def delta(kind: str, name: str, **labels: str) -> float:
        return total(after[kind], name, **labels) - total(before[kind], name, **labels)

    gw = {"model_name": "tiny"}
    for hist in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert delta("gateway", f"meshserve:{hist}_count", **gw) == n, hist
        assert delta("gateway", f"meshserve:{hist}_bucket", le="+Inf", **gw) == n, hist
        assert delta("gateway", f"meshserve:{hist}_sum", **gw) > 0, hist
    generated = sum(c for _, _, c in results)
    assert generated == n * MAX_TOKENS
    # one inter-token gap per delta after the first (a held-back delta merges two steps)
    assert 0 < delta("gateway", "meshserve:inter_token_latency_seconds_count") <= generated - n
    reason = {"finished_reason": "length", **gw}
    assert delta("gateway", "meshserve:request_success_total", **reason) == n

    assert delta("scheduler", "meshserve:scheduler_queue_time_seconds_count") == n
    assert delta("scheduler", "meshserve:scheduler_requests_routed_total") == n
    assert after["scheduler"][("meshserve:scheduler_queue_size", ())] == 0

    ex = "executor"
    for hist in ("request_queue_time", "request_prefill_time", "request_decode_time"):
        assert delta(ex, f"meshserve:{hist}_seconds_count") == n, hist
    assert delta(ex, "meshserve:prompt_tokens_total") == sum(p for _, p, _ in results)
    assert delta(ex, "meshserve:generation_tokens_total") == generated
    # Every pass gave at least one request a token, and some pass ran: 0 < passes <= tokens.
    assert 0 < delta(ex, "meshserve:engine_forward_passes_total") <= generated
    assert delta(ex, "meshserve:prefix_cache_queries_total") >= sum(p for _, p, _ in results)
    assert total(after[ex], "meshserve:num_requests_running") == 0
    assert ("meshserve:spec_decode_num_draft_tokens_total", (("executor_id", "executor-0"),)) in (
        after[ex]
    )
    for why in ("kv_cache_full", "guest_yield"):  # both series, from the start
        series = (("executor_id", "executor-0"), ("reason", why))
        assert ("meshserve:num_preemptions_total", series) in after[ex], why
    assert delta(ex, "meshserve:num_preemptions_total", reason="guest_yield") == 0  # no region
    assert total(after[ex], "meshserve:num_requests_waiting") == 0
    assert 0 <= total(after[ex], "meshserve:kv_cache_usage_perc", executor_id="executor-0") <= 1

    assert delta("tokenizer", "meshserve:messages_handled_total", message="GenerateRequest") == n
    assert delta("detokenizer", "meshserve:messages_handled_total", message="StepTokens") > 0
    assert total(after["tokenizer"], "process_resident_memory_bytes") > 0


async def test_health_and_exemplars_link_metrics_to_traces(mesh, receiver, client):
    rid, _, _ = await send(client, 0)
    async with aiohttp.ClientSession() as session:
        for runtime in runtimes(mesh):
            if runtime.metrics_server is not None:
                url = f"http://127.0.0.1:{runtime.metrics_server.port}/health"
                async with session.get(url) as resp:
                    assert resp.status == 200, runtime.name
        headers = {"Accept": "application/openmetrics-text; version=1.0.0"}
        async with session.get(f"http://127.0.0.1:{mesh.port}/metrics", headers=headers) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            text = await resp.text()
    exemplars = {
        line.split('trace_id="')[1][:32]
        for line in text.splitlines()
        if line.startswith("meshserve:time_to_first_token_seconds_bucket") and "trace_id" in line
    }
    assert exemplars, "no exemplar on the TTFT histogram"
    await asyncio.to_thread(
        receiver.wait_for,
        lambda spans: rid in traces_by_request(spans),
        10,
        lambda: flush_all(mesh),
    )
    known = {s.trace_id for s in receiver.snapshot()}
    assert exemplars <= known  # each exemplar opens a trace Jaeger has


def test_otlp_endpoint_is_the_flag_else_the_standard_variables():
    assert otlp_traces_endpoint("", {}) is None  # no exporter: spans are made, not sent
    assert otlp_traces_endpoint("http://jaeger:4318/", {}) == "http://jaeger:4318/v1/traces"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert otlp_traces_endpoint("", env) == "http://collector:4318/v1/traces"
    assert otlp_traces_endpoint("http://jaeger:4318", env) == "http://jaeger:4318/v1/traces"
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://collector:4318/custom"
    assert otlp_traces_endpoint("", env) == "http://collector:4318/custom"
    assert otlp_traces_endpoint("http://jaeger:4318", {"OTEL_SDK_DISABLED": "true"}) is None
    assert otlp_traces_endpoint("http://jaeger:4318", {"OTEL_TRACES_EXPORTER": "none"}) is None


def test_observability_flags_and_environment(monkeypatch):
    def parse(*argv: str) -> MeshConfig:
        return settings.parse(MeshConfig, list(argv))

    assert parse().metrics_port is None and parse().otlp_endpoint == ""
    config = parse("--otlp-endpoint", "http://jaeger:4318", "--metrics-port", "9100")
    assert (config.otlp_endpoint, config.metrics_port) == ("http://jaeger:4318", 9100)
    monkeypatch.setenv("MESHSERVE_METRICS_PORT", "9200")
    monkeypatch.setenv("MESHSERVE_OTLP_ENDPOINT", "http://collector:4318")
    assert (parse().metrics_port, parse().otlp_endpoint) == (9200, "http://collector:4318")
    with pytest.raises(ValueError):
        MeshConfig(metrics_port=70000)


def test_a_request_received_mid_step_stays_queued(tiny_llama):
    """A request that arrives while a step runs waits in pending_adds; the end of that step
    must not close its queue span (it used to, with the step's start: a negative queue time)."""
    from common.wire.executor import TokenizedRequest
    from common.wire.tokenizer import WireSamplingParams
    from gpu.engine import Engine, EngineConfig
    from gpu.loader import load_model
    from gpu.runner import ModelRunner
    from services.executor.config import parse_args
    from services.executor.service import ExecutorService

    engine = Engine(ModelRunner(load_model(tiny_llama, progress=False), 16, 4), EngineConfig(), [2])
    service = ExecutorService(parse_args(["--model", str(tiny_llama)]), engine)
    try:
        service.timelines.received("mid-step", 5)
        mid_step = TokenizedRequest("mid-step", "_INBOX.t", WireSamplingParams(), [3] * 5, [], 0)
        service.pending_adds.append(mid_step)
        service.timelines.stepped(1, 2, [], service.admitted)
        assert "mid-step" in service.timelines.queued
        service.pending_adds.clear()  # gone without reaching the engine (aborted): not pending
        service.timelines.stepped(3, 4, [], service.admitted)
        assert "mid-step" not in service.timelines.queued
    finally:
        service.worker.shutdown()


def test_hops_offsets_are_relative_to_each_requests_gateway_span():
    from tools.bench.hops import offsets

    def span(trace: str, name: str, start: int, end: int) -> ReceivedSpan:
        return ReceivedSpan("svc", name, trace, f"{trace}-{name}", None, start, end, 1)

    spans = [
        span("a", "gateway.request", 1_000_000, 9_000_000),
        span("a", "tokenizer.encode", 3_000_000, 4_000_000),
        span("b", "gateway.request", 50_000_000, 60_000_000),
        span("b", "tokenizer.encode", 54_000_000, 55_000_000),
        span("c", "tokenizer.encode", 0, 1),  # no root: left out
    ]
    got = offsets(spans)
    assert got["tokenizer.encode start"] == [2.0, 4.0]
    assert got["tokenizer.encode end"] == [3.0, 5.0]
    assert got["gateway.request end"] == [8.0, 10.0]


async def test_a_taken_metrics_port_is_one_clear_line_not_a_traceback():
    import socket

    from prometheus_client import CollectorRegistry

    from common.metrics import MetricsServer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = MetricsServer(CollectorRegistry(), lambda: None, "127.0.0.1", port)
        with pytest.raises(SystemExit, match=f"cannot serve /metrics on 127.0.0.1:{port}: "):
            await server.start()


def test_the_root_span_counts_the_shared_prompt_once() -> None:
    """n choices share one prompt: the span summed it per choice (n x the prompt, n x the
    cached tokens) while the response's usage counts it once."""
    from opentelemetry.trace import INVALID_SPAN_CONTEXT, SpanContext

    from common.metrics import GatewayMetrics, new_registry
    from common.wire.gateway import TextDelta, Usage
    from services.gateway.observe import RequestObserver

    class Recorded:
        def __init__(self) -> None:
            self.attrs: dict[str, object] = {}

        def get_span_context(self) -> SpanContext:
            return INVALID_SPAN_CONTEXT

        def set_attribute(self, key: str, value: object) -> None:
            self.attrs[key] = value

        def set_attributes(self, attributes: dict[str, object]) -> None:
            self.attrs.update(attributes)

    span = Recorded()
    observer = RequestObserver(GatewayMetrics(new_registry(), "m"), span)  # type: ignore[arg-type]
    for index, generated in ((0, 5), (1, 7)):
        usage = Usage(100, generated, cached_tokens=64)
        observer.delta(index, TextDelta(f"r-{index}", "x", "length", usage, seq=1))
    assert span.attrs["gen_ai.usage.prompt_tokens"] == 100
    assert span.attrs["gen_ai.usage.cached_tokens"] == 64
    assert span.attrs["gen_ai.usage.completion_tokens"] == 12
