"""The executor's request timelines (services/executor/timeline.py): what each request adds
to the latency histograms and token counters, once across the mesh."""

from __future__ import annotations

from opentelemetry.trace import NoOpTracer
from prometheus_client import CollectorRegistry

from common.metrics import ExecutorMetrics
from gpu.engine import StepOutput
from gpu.sequence import FinishReason
from services.executor.timeline import HANDOFF, Timelines


def timelines() -> tuple[Timelines, CollectorRegistry]:
    registry = CollectorRegistry()
    # (the snapshot is read only when /metrics is scraped)
    metrics = ExecutorMetrics(registry, "ex", lambda: None)  # type: ignore[arg-type,return-value]
    return Timelines(NoOpTracer(), metrics, "ex"), registry


def value(registry: CollectorRegistry, name: str) -> float:
    return registry.get_sample_value(name, {"executor_id": "ex"}) or 0.0


def first_token(t: Timelines, rid: str) -> None:
    t.stepped(1, 2, [StepOutput(rid, [7], None, 10, 1, 0)], lambda r: True)


def test_a_prompt_prefilled_elsewhere_is_counted_by_its_prefill_executor_only() -> None:
    """Disaggregated: the decode executor counted the prompt tokens and observed a queue and
    a prefill time for a prompt its prefill executor had computed (and counted): the
    dashboard's token throughput doubled and each request was two samples."""
    t, registry = timelines()
    t.received("local", 10)
    first_token(t, "local")
    t.received("remote", 10)
    t.prefilled_elsewhere("remote")
    first_token(t, "remote")
    assert value(registry, "meshserve:prompt_tokens_total") == 10
    assert value(registry, "meshserve:request_prefill_time_seconds_count") == 1
    assert value(registry, "meshserve:request_queue_time_seconds_count") == 1
    t.received("fell-back", 10)  # its prefill executor failed: computed here after all
    t.prefilled_elsewhere("fell-back")
    t.prefilled_elsewhere("fell-back", False)
    first_token(t, "fell-back")
    assert value(registry, "meshserve:prompt_tokens_total") == 20


def test_a_prompt_handed_to_its_decode_executor_has_no_decode_time_here() -> None:
    """The prefill executor's request ends at the handoff: its decode time (about 0) was a
    sample of the decode-time histogram beside the decode executor's real one."""
    t, registry = timelines()
    for rid, reason in (("handed", HANDOFF), ("done", "stop")):
        t.received(rid, 10)
        first_token(t, rid)
        t.finished(rid, reason)
    assert value(registry, "meshserve:request_decode_time_seconds_count") == 1


def test_an_embeddings_token_is_not_counted_as_generated() -> None:
    """Its one greedy token carries the vector and is dropped: counting it made embedding
    traffic look like generation on the dashboard (its prompt tokens count)."""
    t, registry = timelines()
    t.received("embd", 10)
    t.stepped(
        1,
        2,
        [StepOutput("embd", [7], FinishReason.LENGTH, 10, 1, 0, embedding=[0.5])],
        lambda r: True,
    )
    t.received("gen", 10)
    first_token(t, "gen")
    assert value(registry, "meshserve:generation_tokens_total") == 1
    assert value(registry, "meshserve:prompt_tokens_total") == 20
