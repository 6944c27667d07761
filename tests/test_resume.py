"""Request resumption: a message lost on the bus costs the client nothing.

A real mesh (nats-server, tiny Llama) where one message is dropped where a dying NATS server
would drop it: a step of the executor's (``StepTokens``), or a batch of text deltas of the
detokenizer's (``TextDeltas``). The gateway resumes the choice as a continuation and the client
gets the text of an uninterrupted run, token for token, with its usage; an error that is the
request's own is not resumed (``tests/test_resume.py -k not_resumed``, on ``RequestStream``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from common.runtime import RequestError
from common.wire.codec import Message
from common.wire.detokenizer import StepTokens
from common.wire.gateway import ErrorEvent, TextDelta, TextDeltas
from common.wire.tokenizer import GenerateRequest, WireSamplingParams
from services.gateway.resume import continuation
from services.gateway.streams import Inbox, RequestStream
from services.gateway.watchdog import check_stalled
from tests.mesh import MeshHarness, openai_client, resumed, runtime_of
from tools.bench.otlp_receiver import OtlpReceiver


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def mesh(tiny_llama: Path, receiver: OtlpReceiver) -> Iterator[MeshHarness]:
    harness = MeshHarness(tiny_llama, executors=1, otlp_endpoint=receiver.endpoint).start()
    try:
        yield harness
    finally:
        harness.stop()


def resume_events(
    mesh: MeshHarness, receiver: OtlpReceiver, at_least: int = 0
) -> list[dict[str, Any]]:
    """The ``request.resumed`` events of the gateway.request spans exported, once there are
    ``at_least`` (a span ends when its handler returns, which may be after the client read
    the response)."""

    def events(spans: list[Any]) -> list[dict[str, Any]]:
        return [
            attributes
            for span in spans
            if span.name == "gateway.request"
            for name, attributes in span.events
            if name == "request.resumed"
        ]

    def flush() -> None:
        runtime_of(mesh.services[-1]).tracing.flush(5)

    receiver.wait_for(lambda spans: len(events(spans)) >= at_least, 10, flush)
    return events(receiver.snapshot())


class Drop:
    """Drop the first message a service publishes that ``matches`` (as a NATS server that
    dies with it in flight would), once; every other message goes out."""

    def __init__(self, service: Any, decode: type[Message], matches: Callable[[Any], bool]):
        self.runtime = runtime_of(service)
        self.publish = self.runtime.publish
        self.decode, self.matches = decode, matches
        self.dropped: list[Any] = []
        self.runtime.publish = self.lossy  # type: ignore[method-assign]

    async def lossy(self, subject: str, message: Message | bytes, *args: Any, **kw: Any) -> None:
        decoded: Message | bytes | None = message
        if isinstance(message, bytes):
            try:
                decoded = self.decode.decode(message)
            except ValueError:
                decoded = None  # another kind of message
        if not self.dropped and isinstance(decoded, self.decode) and self.matches(decoded):
            self.dropped.append(decoded)
            return
        await self.publish(subject, message, *args, **kw)

    def restore(self) -> None:
        self.runtime.publish = self.publish  # type: ignore[method-assign]


async def complete(
    mesh: MeshHarness, stream: bool, max_tokens: int = 24, **params: Any
) -> tuple[list[str], list[str | None], Any]:
    """Each choice's text and finish reason, and the usage."""
    if stream:
        params = {**params, "stream_options": {"include_usage": True}}
    async with openai_client(mesh.base_url) as client:
        out = await client.completions.create(
            model="tiny",
            prompt="a resumed stream " * 4,
            max_tokens=max_tokens,
            stream=stream,
            extra_body={"ignore_eos": True},
            **params,
        )
        n = params.get("n", 1)
        texts = [""] * n
        finishes: list[str | None] = [None] * n
        usage: Any = None
        if not stream:
            for c in out.choices:  # type: ignore[union-attr]
                texts[c.index], finishes[c.index] = c.text, c.finish_reason
            return texts, finishes, out.usage  # type: ignore[union-attr]
        async for chunk in out:  # type: ignore[union-attr]
            usage = chunk.usage or usage
            for c in chunk.choices:
                texts[c.index] += c.text
                finishes[c.index] = c.finish_reason or finishes[c.index]
        return texts, finishes, usage


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    "lost",
    [
        # A step in the middle: the detokenizer sees the gap in the token count (stream_gap).
        ("executor", lambda seq: seq.output_tokens == 9, "stream_gap"),
        # The first step, with the stream's start: the detokenizer never saw the stream, the
        # executor answers stream_lost.
        ("executor", lambda seq: seq.start is not None, "stream_lost"),
        # Text deltas on their way to the gateway: it sees the gap in the deltas' numbers.
        ("detokenizer", lambda delta: delta.seq == 4, "stream_gap"),
    ],
    ids=["middle-step", "first-step", "delta"],
)
async def test_a_lost_message_is_resumed_and_the_text_is_the_uninterrupted_one(
    mesh: MeshHarness,
    receiver: OtlpReceiver,
    stream: bool,
    lost: tuple[str, Callable[[Any], bool], str],
) -> None:
    where, matches, reason = lost
    expected = await complete(mesh, stream, temperature=0)
    before, events_before = resumed(mesh), len(resume_events(mesh, receiver))
    if where == "executor":
        drop = Drop(mesh.executor_services[0], StepTokens, lambda s: any(map(matches, s.seqs)))
    else:
        detok = next(s for s in mesh.services if type(s).__name__ == "DetokenizerService")
        drop = Drop(detok, TextDeltas, lambda m: any(map(matches, m.deltas)))
    try:
        got = await asyncio.wait_for(complete(mesh, stream, temperature=0), 60)
    finally:
        drop.restore()
    assert drop.dropped, "nothing was dropped"
    assert got[0] == expected[0] and got[1] == ["length"]
    assert got[2].prompt_tokens == expected[2].prompt_tokens
    assert got[2].completion_tokens == expected[2].completion_tokens == 24
    assert resumed(mesh) == before + 1
    [event] = resume_events(mesh, receiver, events_before + 1)[events_before:]
    assert event["meshserve.resume.reason"] == reason
    assert event["meshserve.choice"] == 0 and event["meshserve.resume.attempt"] == 1
    delivered = event["meshserve.resume.delivered_tokens"]
    assert delivered == 0 if reason == "stream_lost" else 0 < delivered < 24


async def test_a_seeded_choice_resumes_with_its_own_draws(mesh: MeshHarness) -> None:
    # Choice i samples with seed + i and its own generator; the continuation skips the draws
    # of the tokens already delivered, so it is the sample an uninterrupted run draws.
    params = {"temperature": 1.0, "seed": 1234, "n": 2}
    expected = await complete(mesh, False, 32, **params)
    assert expected[0][0] != expected[0][1]  # two samples, not greedy twice
    drop = Drop(
        mesh.executor_services[0],
        StepTokens,
        lambda s: any(q.request_id.endswith("-1") and q.output_tokens == 12 for q in s.seqs),
    )
    try:
        got = await asyncio.wait_for(complete(mesh, False, 32, **params), 60)
    finally:
        drop.restore()
    assert drop.dropped
    assert got[0] == expected[0] and got[1] == ["length", "length"]
    assert got[2].completion_tokens == 64 and got[2].prompt_tokens == expected[2].prompt_tokens


async def test_a_lost_last_delta_is_found_by_the_watchdog_and_resumed(
    mesh: MeshHarness,
) -> None:
    # The delta that ends the stream lost: nothing follows it, so only the watchdog (the
    # scheduler no longer knows the request) finds the loss.
    expected = await complete(mesh, True, temperature=0)
    detok = next(s for s in mesh.services if type(s).__name__ == "DetokenizerService")
    drop = Drop(detok, TextDeltas, lambda m: any(d.finish_reason for d in m.deltas))
    gateway = mesh.services[-1].mesh
    try:
        task = asyncio.ensure_future(complete(mesh, True, temperature=0))
        for _ in range(300):  # the watchdog's own rounds are 5 s apart: ask at once instead
            if task.done():
                break
            if drop.dropped:
                mesh.call(check_stalled(gateway.service, gateway.inbox, stall_s=0))
            await asyncio.sleep(0.1)
        got = await asyncio.wait_for(task, 30)
    finally:
        drop.restore()
    assert got[0] == expected[0] and got[1] == ["length"]
    assert got[2].completion_tokens == 24


class Resubmits:
    """Records the continuations a stream asks for; ``refuse`` makes the mesh refuse them."""

    def __init__(self, inbox: Inbox, refuse: bool = False) -> None:
        self.inbox, self.refuse = inbox, refuse
        self.sent: list[tuple[GenerateRequest, str]] = []

    async def resubmit(self, stream: RequestStream, request: GenerateRequest, lost: str) -> None:
        if self.refuse:
            raise RequestError("no mesh", 503, "server_error", code="mesh_unavailable")
        self.inbox.route(stream, [request.request_id, *request.choice_ids()])
        self.sent.append((request, lost))


def origin(n: int = 1) -> GenerateRequest:
    params = WireSamplingParams(max_tokens=8, temperature=0.7, seed=5)
    return GenerateRequest("req", "inbox", params, prompt="hi", n=n)


def opened(inbox: Inbox, resubmits: Resubmits, n: int = 1, max_resumes: int = 2) -> RequestStream:
    request = origin(n)
    stream = inbox.open(request.choice_ids(), 30, request.request_id)
    stream.origin, stream.resubmitter, stream.max_resumes = request, resubmits, max_resumes
    return stream


async def test_a_continuation_carries_what_the_client_has_and_its_choice_seed() -> None:
    inbox = Inbox()
    resubmits = Resubmits(inbox)
    stream = opened(inbox, resubmits, n=2)
    stream.put(TextDelta("req-1", "a", seq=1, token_ids=[7, 8]))
    assert await anext(stream) == (1, TextDelta("req-1", "a", seq=1, token_ids=[7, 8]))
    stream.put(TextDelta("req-1", "c", seq=3, token_ids=[11]))  # delta 2 lost
    stream.put(TextDelta("req-1", "late", seq=4, token_ids=[12]))  # the lost attempt goes on
    stream.put(TextDelta("req-1-r1-0", "bc", seq=1, token_ids=[9, 11]))
    assert await anext(stream) == (1, TextDelta("req-1-r1-0", "bc", seq=1, token_ids=[9, 11]))
    [(request, lost)] = resubmits.sent
    assert lost == "req-1" and request.request_id == "req-1-r1"
    assert request.output_token_ids == [7, 8] and request.n == 1
    assert request.params.seed == 6  # choice 1's: seed + 1
    assert request == continuation(origin(2), 1, [7, 8], 1)
    assert stream.unfinished == ["req-0", "req-1-r1-0"]  # what a client leaving aborts


@pytest.mark.parametrize(
    "error",
    [
        ErrorEvent("req-0", 400, "bad logit_bias"),
        ErrorEvent("req-0", 503, "queue full", "server_error", "queue_full"),
        ErrorEvent("req-0", 504, "timed out", "timeout_error", "request_timeout"),
    ],
)
async def test_an_error_of_the_request_itself_is_not_resumed(error: ErrorEvent) -> None:
    inbox = Inbox()
    resubmits = Resubmits(inbox)
    stream = opened(inbox, resubmits)
    stream.put(error)
    with pytest.raises(RequestError) as raised:
        await anext(stream)
    assert (raised.value.status, raised.value.code) == (error.status, error.code)
    assert not resubmits.sent


async def test_resumes_are_bounded_and_a_refused_one_fails_with_the_loss() -> None:
    inbox = Inbox()
    resubmits = Resubmits(inbox)
    stream = opened(inbox, resubmits, max_resumes=2)
    lost = "The stream lost part of its tokens on the way; retry the request."
    for rid in ("req-0", "req-0-r1-0", "req-0-r2-0"):
        stream.put(ErrorEvent(rid, 503, lost, "server_error", "stream_gap"))
    with pytest.raises(RequestError) as raised:
        await anext(stream)
    assert (raised.value.status, raised.value.code) == (503, "stream_gap")
    assert [r.request_id for r, _ in resubmits.sent] == ["req-0-r1", "req-0-r2"]
    refused = opened(Inbox(), Resubmits(inbox, refuse=True))
    refused.put(ErrorEvent("req-0", 503, lost, "server_error", "request_lost"))
    with pytest.raises(RequestError) as raised:
        await anext(refused)
    assert raised.value.code == "request_lost"


@pytest.mark.parametrize("refuse", [False, True], ids=["no-resumes-left", "resume-refused"])
async def test_a_choice_lost_in_transit_and_not_resumed_is_still_aborted(refuse: bool) -> None:
    """A gap the gateway finds means the stream still runs upstream: with no resume (none
    left, or the mesh refusing one) the client gets the 503, and the choice's attempt is
    among what ``release`` aborts, where it ran on to max_tokens or its deadline."""
    inbox = Inbox()
    stream = opened(inbox, Resubmits(inbox, refuse=refuse), max_resumes=1 if refuse else 0)
    stream.put(TextDelta("req-0", "a", seq=1, token_ids=[5]))
    await anext(stream)
    stream.put(TextDelta("req-0", "c", seq=3, token_ids=[7]))  # delta 2 lost
    with pytest.raises(RequestError) as raised:
        await anext(stream)
    assert (raised.value.status, raised.value.code) == (503, "stream_gap")
    assert stream.unfinished == ["req-0"]


async def test_an_abandoned_attempt_that_still_sends_is_no_sign_of_life_and_is_aborted() -> None:
    """Across a partition the abort of a resumed choice's old attempt was lost, and that
    attempt, healed, went on streaming: each of its events counted as a sign of life for the
    watchdog, which so never found the continuation lost, and nothing aborted it again."""
    inbox = Inbox()
    abandoned: list[str] = []
    inbox.on_abandoned = abandoned.append
    stream = opened(inbox, Resubmits(inbox))
    lost = "The request was lost in the mesh (a service restarted); retry the request."
    stream.put(ErrorEvent("req-0", 503, lost, "server_error", "request_lost"))
    stream.put(TextDelta("req-0-r1-0", "a", seq=1, token_ids=[5]))
    assert (await anext(stream))[1].request_id == "req-0-r1-0"
    assert stream.abandoned("req-0") and not stream.abandoned("req-0-r1-0")
    stream.last_event_at, stream.unknown_checks = 0.0, {"req-0-r1-0": 1}  # it went silent
    inbox.deliver(TextDeltas([TextDelta("req-0", "zombie", seq=9, token_ids=[9])]).encode())
    assert stream.last_event_at == 0.0 and stream.unknown_checks == {"req-0-r1-0": 1}
    assert abandoned == ["req-0"]
    inbox.deliver(TextDeltas([TextDelta("req-0-r1-0", "b", seq=2, token_ids=[6])]).encode())
    assert stream.last_event_at > 0.0 and stream.unknown_checks == {}
    assert (await anext(stream))[1].text == "b"  # the zombie's delta never reached the client


async def test_the_gateway_aborts_an_abandoned_attempt_again_at_most_every_few_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.gateway import GatewayConfig
    from services.gateway.mesh_client import ABANDONED_ABORT_S, MeshClient

    client = MeshClient(GatewayConfig())
    aborted: list[tuple[list[str], str]] = []

    async def publish_abort(ids: list[str], reason: str) -> None:
        aborted.append((ids, reason))

    monkeypatch.setattr(client, "_publish_abort", publish_abort)
    now = [100.0]
    client._reaborted.clock = lambda: now[0]
    for _ in range(3):
        client.inbox.on_abandoned("req-0")  # type: ignore[misc]
    await asyncio.sleep(0)
    assert aborted == [(["req-0"], "resumed as a continuation")]
    now[0] += ABANDONED_ABORT_S + 0.1
    client.inbox.on_abandoned("req-0")  # type: ignore[misc]
    await asyncio.sleep(0)
    assert len(aborted) == 2


async def test_a_finished_stream_aborts_the_attempts_it_was_resumed_away_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Old attempts were re-aborted only while their stream was open: once the continuation
    finished, release aborted nothing, and an old attempt whose abort was lost across a
    partition streamed on, unrouted, to max_tokens."""
    from services.gateway import GatewayConfig
    from services.gateway.mesh_client import MeshClient

    client = MeshClient(GatewayConfig())
    aborted: list[list[str]] = []

    async def publish_abort(ids: list[str], reason: str) -> None:
        aborted.append(ids)

    monkeypatch.setattr(client, "_publish_abort", publish_abort)
    stream = opened(client.inbox, Resubmits(client.inbox))
    lost = "The request was lost in the mesh (a service restarted); retry the request."
    stream.put(ErrorEvent("req-0", 503, lost, "server_error", "request_lost"))
    stream.put(TextDelta("req-0-r1-0", "a", finish_reason="stop", seq=1, token_ids=[5]))
    assert [delta.text async for _, delta in stream] == ["a"]
    assert stream.unfinished == [] and stream.left_behind == ["req-0"]
    await client.release(stream)
    assert aborted == [["req-0"]]


async def test_a_continuation_over_the_bus_limit_is_refused_before_it_is_published(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It carries the delivered tokens on top of the request: past the server's limit with
    its headers, the server would have cut the gateway's connection and every stream on it."""
    from types import SimpleNamespace

    from services.gateway import GatewayConfig
    from services.gateway.mesh_client import MeshClient

    client = MeshClient(GatewayConfig())
    published: list[str] = []

    async def publish(subject: str, payload: bytes, headers: object = None) -> None:
        published.append(subject)

    async def nothing(*args: object) -> None:
        return None

    nc = SimpleNamespace(max_payload=2000, is_connected=True, publish=publish)
    monkeypatch.setattr(client.service, "_nc", nc)
    monkeypatch.setattr(client, "_publish_abort", nothing)
    stream = opened(client.inbox, Resubmits(client.inbox))
    big = continuation(origin(), 0, list(range(5000)), 1)
    with pytest.raises(RequestError) as refused:
        await client.resubmit(stream, big, "req-0")
    assert (refused.value.status, refused.value.code) == (413, "request_too_large")
    assert published == []
    await client.resubmit(stream, continuation(origin(), 0, [5, 6], 1), "req-0")
    assert published == [client.subjects.tokenizer_encode]
