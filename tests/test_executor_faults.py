"""The executor's failure paths on a real nats-server: payloads over the bus's limit, aborts
that arrive before their request, withdraw-and-resubmit, duplicate submits, and a publish
that fails. Each asserts what the client side receives and that the pages come back."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict
from typing import Any

import nats
import nats.errors
import pytest

from common.nats_server import LocalNatsServer
from common.tokenizer import Tokenizer
from common.wire.detokenizer import StepTokens
from common.wire.executor import AbortRequests, TokenizedRequest, WireGrammar
from common.wire.gateway import ErrorEvent
from common.wire.tokenizer import ResponseFormat, WireSamplingParams
from services.executor.service import ExecutorService
from services.tokenizer.grammars import grammar_for
from tests.mesh import tiny_executor

MAX_PAYLOAD = 8192


@pytest.fixture
def small_nats(tmp_path):
    conf = tmp_path / "nats.conf"
    conf.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    server = LocalNatsServer.start(extra_args=["-c", str(conf)])
    yield server
    server.stop()


class Observer:
    """What a detokenizer and a gateway would receive from the executor."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finished: dict[str, str] = {}
        self.errors: dict[str, ErrorEvent] = {}
        self.aborts: list[AbortRequests] = []
        self.step_messages = 0
        self.stop_token: dict[str, bool] = {}  # as each finished stream's last message said

    async def on_step(self, msg) -> None:
        assert len(msg.data) <= MAX_PAYLOAD
        self.step_messages += 1
        for seq in StepTokens.decode(msg.data).seqs:
            self.tokens[seq.request_id].extend(seq.token_ids)
            if seq.finish_reason:
                self.finished[seq.request_id] = seq.finish_reason
                self.stop_token[seq.request_id] = seq.stop_token

    async def on_inbox(self, msg) -> None:
        error = ErrorEvent.decode(msg.data)
        self.errors[error.request_id] = error

    async def on_abort(self, msg) -> None:
        self.aborts.append(AbortRequests.decode(msg.data))

    async def wait_for(self, *ids: str, timeout: float = 30) -> None:
        async with asyncio.timeout(timeout):
            while not all(i in self.finished or i in self.errors for i in ids):
                await asyncio.sleep(0.02)


@pytest.fixture
async def executor(small_nats, tiny_llama):
    service = tiny_executor(small_nats.url, tiny_llama, "ex-0", kv_cache_tokens=1024)
    config = service.config
    await service.start()
    nc = await nats.connect(small_nats.url)
    seen = Observer()
    s = config.mesh.subjects
    await nc.subscribe(s.detok(0), cb=seen.on_step)
    await nc.subscribe("test.inbox", cb=seen.on_inbox)
    await nc.subscribe(s.abort, cb=seen.on_abort)

    async def send(message) -> None:
        subject = s.abort if isinstance(message, AbortRequests) else s.executor_submit("ex-0")
        await nc.publish(subject, message.encode())
        await nc.flush()

    yield service, send, seen
    await nc.close()
    await service.stop()
    service.worker.shutdown()


def request(rid: str, max_tokens: int = 8, stop: list[str] | None = None, **kw) -> TokenizedRequest:
    params = WireSamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=stop or []
    )
    return TokenizedRequest(rid, "test.inbox", params, [5, 6, 7, 8, 9], [], 0, **kw)


async def idle(service: ExecutorService) -> None:
    async with asyncio.timeout(10):
        while service.requests or service.engine.has_unfinished() or service.pending_adds:
            await asyncio.sleep(0.02)
    assert service.engine.pages.num_free == service.engine.pages.num_pages


async def test_a_step_over_the_payload_limit_is_split_and_every_stream_completes(executor):
    service, send, seen = executor
    stops = [f"stop-{i:03d}-" + "x" * 90 for i in range(10)]  # ~1 KB per request's start
    ids = [f"r{i}" for i in range(12)]  # together ~12 KB in one step: over 8 KB
    for rid in ids:
        await send(request(rid, stop=stops))
    await seen.wait_for(*ids)
    assert seen.errors == {}
    assert all(len(seen.tokens[rid]) == 8 for rid in ids)
    assert seen.step_messages > 8  # the first steps went out in several messages each
    await idle(service)


async def test_one_request_too_large_to_stream_fails_alone_and_the_executor_serves_on(executor):
    service, send, seen = executor
    await send(request("huge", stop=["y" * 3700, "z" * 3700]))  # fits a submit, not a step
    await send(request("small"))
    await seen.wait_for("huge", "small")
    assert seen.errors["huge"].status == 400 and seen.errors["huge"].param == "stop"
    assert "payload limit" in seen.errors["huge"].message
    assert "huge" not in seen.tokens
    assert len(seen.tokens["small"]) == 8 and "small" not in seen.errors
    assert any(a.request_ids == ["huge"] and not a.executor_id for a in seen.aborts)
    await send(request("after"))
    await seen.wait_for("after")
    assert len(seen.tokens["after"]) == 8
    await idle(service)


async def test_a_stream_ended_by_a_stop_token_says_so(executor):
    """The detokenizer leaves the stop token's text out (it cannot tell an EOS or a
    stop_token_ids entry from the ids alone): the executor marks the step that ended on one."""
    service, send, seen = executor
    await send(request("probe", max_tokens=3))
    await seen.wait_for("probe")
    probe = seen.tokens["probe"]
    first = probe[1]  # the greedy run's second token: a stop token now
    stopping = request("stopped", max_tokens=3)
    params = dataclasses.replace(stopping.params, stop_token_ids=[first])
    await send(dataclasses.replace(stopping, params=params))
    await seen.wait_for("stopped")
    assert seen.tokens["stopped"] == probe[: probe.index(first) + 1]
    assert seen.finished["stopped"] == "stop" and seen.stop_token["stopped"]
    assert seen.finished["probe"] == "length" and not seen.stop_token["probe"]
    # min_tokens (vLLM's) keeps that stop token out of the first 3
    late = dataclasses.replace(stopping, request_id="late")
    await send(dataclasses.replace(late, params=dataclasses.replace(params, min_tokens=3)))
    await seen.wait_for("late")
    assert first not in seen.tokens["late"][:3] and len(seen.tokens["late"]) == 3
    await idle(service)


async def test_an_abort_that_arrives_before_its_request_wins(executor):
    service, send, seen = executor
    await send(AbortRequests(["early"], "client disconnected"))
    await send(request("early"))
    await send(request("other"))
    await seen.wait_for("other")
    await asyncio.sleep(0.1)
    assert "early" not in seen.tokens and "early" not in seen.errors
    assert "early" not in service.requests
    await idle(service)


async def test_withdraw_then_resubmit_runs_the_new_one_and_duplicates_run_once(executor):
    service, send, seen = executor
    await send(request("w", max_tokens=200))
    async with asyncio.timeout(10):
        while len(seen.tokens["w"]) < 3:
            await asyncio.sleep(0.01)
    # The scheduler withdraws it (targeted abort) and sends it back with what it streamed.
    await send(AbortRequests(["w"], "moved", executor_id="ex-0"))
    streamed = list(seen.tokens["w"])
    seen.tokens["w"].clear()
    await send(request("w", max_tokens=200, output_token_ids=streamed[:3], migrations=1))
    await send(AbortRequests(["w"], "moved", executor_id="another-executor"))  # not ours
    await send(request("dup"))
    await send(request("dup"))
    await seen.wait_for("w", "dup")
    assert seen.errors == {}
    assert service.engine.seqs == {}
    assert len(seen.tokens["dup"]) == 8  # one run, not two, and no "already in use" error
    await idle(service)


async def test_a_failed_publish_ends_those_streams_not_the_step_loop(executor, monkeypatch):
    service, send, seen = executor
    real_publish = service.svc.nc.publish
    failures = 0

    async def flaky(subject, payload=b"", reply="", headers=None):
        nonlocal failures
        if subject == service.subjects.detok(0) and failures < 1:
            failures += 1
            raise nats.errors.OutboundBufferLimitError
        await real_publish(subject, payload, reply, headers)

    monkeypatch.setattr(service.svc.nc, "publish", flaky)
    await send(request("lost"))
    await seen.wait_for("lost")
    assert seen.errors["lost"].status == 503 and seen.errors["lost"].code == "delivery_failed"
    await send(request("next"))
    await seen.wait_for("next")
    assert len(seen.tokens["next"]) == 8
    assert not any(t.done() for t in service.svc._tasks)  # the step loop lives on
    await idle(service)


async def test_a_failed_stream_is_reported_to_its_client_by_the_executor_holding_it(executor):
    service, send, seen = executor
    await send(request("doomed", max_tokens=200))
    async with asyncio.timeout(10):
        while not seen.tokens["doomed"]:
            await asyncio.sleep(0.01)
    await send(AbortRequests(["doomed"], "detokenizer lost the stream", error="interrupted"))
    await seen.wait_for("doomed")
    error = seen.errors["doomed"]
    assert (error.status, error.code, error.message) == (503, "stream_lost", "interrupted")
    await idle(service)


async def test_a_submit_that_reaches_a_draining_executor_still_runs(executor):
    """Sent by the scheduler before it saw the draining heartbeat: the step loop, idle when
    the drain began, must still run it (it had returned, and the request waited out the 30 s
    drain while the heartbeats listed it as running here)."""
    service, send, seen = executor
    await service.drain()
    await asyncio.sleep(0.2)  # the step loop finds nothing to do
    await send(request("late"))
    await seen.wait_for("late", timeout=10)
    assert len(seen.tokens["late"]) == 8 and "late" not in seen.errors
    await idle(service)


async def test_a_grammar_compiler_that_fails_ends_its_requests_with_an_error(executor, monkeypatch):
    """Not the request's fault (xgrammar refusing the vocabulary, say): a 500 at once and
    nothing left compiling, where the request hung until its deadline; the next constrained
    request builds the compiler again."""
    service, send, seen = executor
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("vocabulary size mismatch (simulated)")

    monkeypatch.setattr("services.executor.service.tokenizer_info", broken)
    grammar = WireGrammar("k", 'root ::= "a"')
    await send(request("g1", grammar=grammar))
    await seen.wait_for("g1", timeout=10)
    assert seen.errors["g1"].status == 500 and "vocabulary size" in seen.errors["g1"].message
    assert service.compiling == {} and service.compiled == {}
    await send(request("g2", grammar=grammar))
    await seen.wait_for("g2", timeout=10)
    assert seen.errors["g2"].status == 500 and len(calls) == 2  # built again, not memoized
    await send(request("plain"))
    await seen.wait_for("plain")
    assert len(seen.tokens["plain"]) == 8
    await idle(service)


async def test_a_replayed_constrained_submit_runs_once_and_leaves_nothing(executor):
    service, send, seen = executor
    grammar = WireGrammar("k", 'root ::= "a" "b"*')
    await send(request("g", max_tokens=60, grammar=grammar))
    async with asyncio.timeout(10):
        while "g" not in service.requests:  # running: its grammar compiled and was used
            await asyncio.sleep(0.001)
    await service.on_submit(request("g", max_tokens=60, grammar=grammar))  # (at once)
    await seen.wait_for("g")
    assert "g" not in seen.errors
    await idle(service)
    assert service.compiled == {} and service.compiling == {}


async def test_a_constrained_request_withdrawn_and_sent_back_runs_again(executor):
    """The scheduler moves a running constrained request and the move brings it back here
    before the abort is applied (between steps): the new submit is not a replay, and runs."""
    service, send, seen = executor
    grammar = WireGrammar("abc", 'root ::= "abcdefghijklmnopqrstuvwxyz"')
    await send(request("g", max_tokens=60, grammar=grammar))
    async with asyncio.timeout(10):
        while "g" not in service.requests:
            await asyncio.sleep(0.001)
    await service.on_abort(AbortRequests(["g"], "moved", executor_id="ex-0"))
    await service.on_submit(request("g", max_tokens=60, grammar=grammar, migrations=1))
    await seen.wait_for("g")
    assert "g" not in seen.errors and seen.finished["g"] == "stop"
    await idle(service)
    assert service.compiled == {} and service.compiling == {}


async def test_a_duplicate_submit_and_an_abort_between_two_steps_stop_the_running_one(executor):
    """The abort forgot the duplicate waiting to be added by id, which took the running copy's
    entry with it, so the engine was never told: the request ran to max_tokens for nobody,
    holding its pages and a slot."""
    service, send, seen = executor
    real_step = service.engine.step

    def slow_step() -> Any:  # (the 240 tokens it may run then take seconds)
        time.sleep(0.02)
        return real_step()

    service.engine.step = slow_step
    await send(request("w", max_tokens=240))
    async with asyncio.timeout(10):
        while len(seen.tokens["w"]) < 2:
            await asyncio.sleep(0.01)
    import traceback

    real_abort = service.engine.abort

    def traced(rid):
        traceback.print_stack(limit=6)
        return real_abort(rid)

    service.engine.abort = traced
    await service.on_submit(request("w", max_tokens=240))  # a replayed submit
    await service.on_abort(AbortRequests(["w"], "client left"))  # before the next step
    await asyncio.sleep(0.3)
    assert "w" not in service.engine.seqs and "w" not in service.requests
    await idle(service)


async def test_a_constrained_request_withdrawn_while_it_compiles_runs_its_new_submit(
    executor, tiny_llama
):
    """The old submit's compile took the new one's place (by id): the old request ran, from
    scratch, and the new one with the tokens its client had was lost."""
    service, _, seen = executor
    tok = Tokenizer.from_folder(tiny_llama)
    grammar = grammar_for(ResponseFormat("json_object"), None, "hermes")
    old = request("g", max_tokens=8, grammar=grammar)
    streamed = tok.encode('{"', add_special_tokens=False)
    new = request("g", max_tokens=8, grammar=grammar, output_token_ids=streamed, migrations=1)
    await service.on_submit(old)  # its compile starts; nothing below waits for it
    await service.on_abort(AbortRequests(["g"], "moved", executor_id="ex-0"))
    await service.on_submit(new)
    await seen.wait_for("g")
    assert "g" not in seen.errors
    assert len(seen.tokens["g"]) == 8 - len(streamed)  # the new run, after what it had
    await idle(service)


async def test_a_request_on_an_adapter_it_does_not_serve_is_a_404(executor):
    """The scheduler routes by the adapters executors announce, but one may have left or
    restarted with other flags meanwhile: such a request is an unknown model, not a bad body."""
    service, send, seen = executor
    await send(request("x", lora="not-here"))
    await seen.wait_for("x")
    error = seen.errors["x"]
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
    assert "`not-here` (a LoRA adapter) is not loaded here" in error.message
    await idle(service)
