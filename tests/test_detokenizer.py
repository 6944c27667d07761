"""The detokenizer service over a real nats-server: UTF-8 safe deltas and stop strings."""

from __future__ import annotations

import asyncio
import shutil

import nats
import pytest
from tokenizers import Tokenizer as Backend

from common.config import MeshConfig
from common.nats_server import LocalNatsServer
from common.tokenizer import Tokenizer
from common.wire.codec import decode_any
from common.wire.detokenizer import (
    PROMPT_TAIL_TOKENS,
    SeqTokens,
    StepTokens,
    StreamStart,
    WireTokenLogprob,
)
from common.wire.executor import AbortRequests
from common.wire.gateway import ErrorEvent, TextDelta, TextDeltas
from services.detokenizer.service import DetokenizerConfig, DetokenizerService
from services.detokenizer.stops import StopMatcher
from tests.test_tokenizer import train_sentencepiece_like, write_tokenizer_folder

TEXT = "数据中心的服务器😀🌍 über Ærø, 模型推理 ✨"  # not in the tiny tokenizer's corpus


@pytest.fixture(scope="module")
def nats_server():
    server = LocalNatsServer.start(jetstream=False)
    yield server
    server.stop()


class ClientInbox:
    """What a gateway's inbox receives: text deltas, error events, each message's size."""

    def __init__(self, errors: list[ErrorEvent] | None = None) -> None:
        self.deltas: list[TextDelta] = []
        self.errors = errors if errors is not None else []
        self.sizes: list[int] = []

    async def on_msg(self, msg) -> None:
        self.sizes.append(len(msg.data))
        message = decode_any(msg.data, TextDeltas, ErrorEvent)
        if isinstance(message, ErrorEvent):
            self.errors.append(message)
        else:
            self.deltas.extend(message.deltas)  # type: ignore[attr-defined]


async def run_stream(
    nats_server, model, token_ids, stop, tokens_per_step=1, lost=(), errors=None, prior=(), rid="r1"
):
    """Send ``token_ids`` through a detokenizer shard, less the steps numbered in ``lost``;
    return (deltas, aborts); error events sent to the client go to ``errors``. ``prior``: the
    stream resumes a lost one after these tokens (``StreamStart.output_token_ids``)."""
    svc = DetokenizerService(DetokenizerConfig(MeshConfig(nats_server.url), str(model)))
    await svc.start()
    nc = await nats.connect(nats_server.url)
    inbox = ClientInbox(errors)
    deltas, errors, aborts = inbox.deltas, inbox.errors, []

    async def on_abort(msg):
        aborts.extend(AbortRequests.decode(msg.data).request_ids)

    await nc.subscribe("test.inbox", cb=inbox.on_msg)
    await nc.subscribe(svc.svc.subjects.abort, cb=on_abort)
    steps = [token_ids[i : i + tokens_per_step] for i in range(0, len(token_ids), tokens_per_step)]
    for i, chunk in enumerate(steps):
        last = i == len(steps) - 1
        start = None
        if i == 0:
            start = StreamStart(stop, True, 3, 0, reply_to="test.inbox", output_token_ids=[*prior])
        seq = SeqTokens(
            rid,
            chunk,
            "length" if last else None,
            len(prior) + min((i + 1) * tokens_per_step, len(token_ids)),
            start,
        )
        if i not in lost:
            await nc.publish(svc.svc.subjects.detok(0), StepTokens("ex", [seq]).encode())
    await nc.flush()
    for _ in range(100):
        if any(d.finish_reason for d in deltas) or errors:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    await nc.close()
    await svc.svc.close()
    return deltas, aborts


@pytest.mark.parametrize("per_step", [1, 3])
async def test_multibyte_text_streams_without_replacement_chars(nats_server, tiny_llama, per_step):
    tok = Tokenizer.from_folder(tiny_llama)
    ids = tok.encode(TEXT, add_special_tokens=False)
    # characters really are split across tokens (a token alone decodes to U+FFFD)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas, _ = await run_stream(nats_server, tiny_llama, ids, [], per_step)
    pieces = [d.text for d in deltas]
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == len(ids)


async def test_stop_string_across_tokens_is_cut_and_aborts(nats_server, tiny_llama):
    tok = Tokenizer.from_folder(tiny_llama)
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text, add_special_tokens=False)
    deltas, aborts = await run_stream(nats_server, tiny_llama, ids, ["fox jum"])
    out = "".join(d.text for d in deltas)
    assert out == "The quick brown "
    assert deltas[-1].finish_reason == "stop"
    assert aborts == ["r1"]


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["</end>", "STOP"])
    assert m.feed("hello </") == "hello "
    assert m.feed("en") == ""
    assert m.feed("x more") == "</enx more"
    assert m.feed(" ST") == " "
    assert m.feed("OP and more") == ""
    assert m.stopped and m.feed("later") == ""
    m2 = StopMatcher(["abc"])
    assert m2.feed("xxab") == "xx"
    assert m2.flush() == "ab"
    assert StopMatcher([]).feed("anything") == "anything"


def test_a_stop_string_completed_under_min_tokens_ends_nothing_later():
    """ "\n" is held whole (a prefix of "\nUser:") when it comes under min_tokens; the next
    feed found it and stopped, where vLLM only matches stop strings that end in new text. One
    that begins under min_tokens and ends after it still stops."""
    m = StopMatcher(["\n", "\nUser:"])
    assert m.feed("Sure\n", may_stop=False) == "Sure"
    assert m.feed(" here", may_stop=True) == "\n here" and not m.stopped
    assert m.feed(" now\n") == " now" and m.stopped
    m = StopMatcher(["\nUser:"])
    assert m.feed("Sure\nUs", may_stop=False) == "Sure"
    assert m.feed("er: hi") == "" and m.stopped


async def test_a_lost_step_message_fails_the_stream_instead_of_losing_its_text(
    nats_server, tiny_llama
):
    # Core NATS drops what was in flight on a server that died: the next step's token count
    # shows the gap, and the client gets a retryable 503, not a 200 with text missing.
    tok = Tokenizer.from_folder(tiny_llama)
    ids = tok.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    errors: list[ErrorEvent] = []
    deltas, aborts = await run_stream(nats_server, tiny_llama, ids, [], lost={2}, errors=errors)
    assert [(e.status, e.code) for e in errors] == [(503, "stream_gap")]
    assert "retry" in errors[0].message
    assert aborts == ["r1"]
    assert len(deltas) == 2 and not any(d.finish_reason for d in deltas)


@pytest.mark.parametrize(
    ("text", "stop"),
    [(TEXT, []), ("The quick brown fox jumps over the lazy dog.", ["fox jumps high"])],
)
async def test_a_resumed_stream_continues_the_text_the_client_has(
    nats_server, tiny_llama, text, stop
):
    # The gateway resumes a stream that lost a step from the tokens of the deltas it took
    # (TextDelta.token_ids): the new stream replays them and sends only what follows, even when
    # the lost stream was holding text back (half a character, a possible stop string).
    tok = Tokenizer.from_folder(tiny_llama)
    ids = tok.encode(text, add_special_tokens=False)
    # Cuts where the client has tokens whose text was held back (a possible stop string; this
    # byte-level tokenizer completes a character within one delta): the hard places to cut.
    held_at = []
    # The step lost is followed by one that shows the gap; every cut of the short text, every
    # third of the long one (a detokenizer per run: seconds).
    for k in range(1, len(ids) - 1, 1 if len(ids) < 32 else 3):
        errors: list[ErrorEvent] = []
        deltas, _ = await run_stream(nats_server, tiny_llama, ids, stop, lost={k}, errors=errors)
        assert [e.code for e in errors] == ["stream_gap"]
        delivered = [t for d in deltas for t in d.token_ids]
        seen = "".join(d.text for d in deltas)
        if tok.decode(delivered) != seen:
            held_at.append(k)
        rest, _ = await run_stream(
            nats_server, tiny_llama, ids[len(delivered) :], stop, prior=delivered, rid="r1-r1-0"
        )
        assert seen + "".join(d.text for d in rest) == text, k
        assert [t for d in rest for t in d.token_ids] == ids[len(delivered) :]
        assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == len(ids)
        assert rest[-1].seq == len(rest)  # numbered from 1 again: a stream of its own
    assert held_at or not stop, "no cut fell where the stream held text back"


SMALL_PAYLOAD = 8192  # the small server's max_payload
HEADROOM = 1024  # what an executor leaves under it for headers (``PAYLOAD_HEADROOM``)


@pytest.fixture
def small_nats(tmp_path):
    conf = tmp_path / "nats.conf"
    conf.write_text(f"max_payload: {SMALL_PAYLOAD}\n")
    server = LocalNatsServer.start(jetstream=False, extra_args=["-c", str(conf)])
    yield server
    server.stop()


async def test_text_deltas_over_the_bus_limit_are_split_and_an_oversized_one_fails_its_stream(
    small_nats, tiny_llama
):
    """Text and logprobs take more bytes than the token ids an executor fitted under the bus's
    limit: the deltas for one gateway go out in as many messages as they need, each under
    it, and a stream whose own delta cannot fit ends with a clear error (its executor told),
    where the whole message failed to publish and every stream in it lost its text."""
    svc = DetokenizerService(DetokenizerConfig(MeshConfig(small_nats.url), str(tiny_llama)))
    await svc.start()
    nc = await nats.connect(small_nats.url)
    inbox = ClientInbox()
    sizes, deltas, errors = inbox.sizes, inbox.deltas, inbox.errors
    aborts: list[AbortRequests] = []

    async def on_abort(msg):
        aborts.append(AbortRequests.decode(msg.data))

    await nc.subscribe("test.inbox", cb=inbox.on_msg)
    await nc.subscribe(svc.svc.subjects.abort, cb=on_abort)
    top = [(t, -float(t)) for t in range(100, 120)]  # 20 alternatives

    def seq(rid: str, tokens: int, first: bool) -> SeqTokens:
        """``tokens`` tokens with logprobs: the first of the stream (1), or its last."""
        ids = list(range(40, 40 + tokens))
        logprobs = [WireTokenLogprob(t, -0.5, top) for t in ids]
        if first:
            start = StreamStart([], True, 3, 0, reply_to="test.inbox")
            return SeqTokens(rid, ids, None, tokens, start, logprobs)
        return SeqTokens(rid, ids, "length", 1 + tokens, None, logprobs)

    # Streams whose last deltas together outgrow the limit, and one whose own delta does.
    names = [f"s{i}" for i in range(8)]
    steps = [
        StepTokens("ex", [seq(rid, 1, True) for rid in [*names, "big"]]),
        StepTokens("ex", [seq(rid, 3, False) for rid in names]),
        StepTokens("ex", [seq("big", 25, False)]),
    ]
    try:
        for step in steps:
            assert len(step.encode()) <= SMALL_PAYLOAD - HEADROOM  # as an executor sends it
            await nc.publish(svc.svc.subjects.detok(0), step.encode())
        await nc.flush()
        for _ in range(200):
            if len([d for d in deltas if d.finish_reason]) == len(names) and errors and aborts:
                break
            await asyncio.sleep(0.02)
        last = {d.request_id: d for d in deltas if d.finish_reason == "length"}
        assert sorted(last) == names and all(len(d.logprobs or []) == 3 for d in last.values())
        assert max(sizes) <= SMALL_PAYLOAD and len(sizes) >= 4  # the second step's deltas split
        assert [(e.request_id, e.status) for e in errors] == [("big", 400)]
        assert "payload limit" in errors[0].message and errors[0].param == "top_logprobs"
        assert [a.request_ids for a in aborts] == [["big"]]
        assert "big" not in svc.streams and "s0" not in svc.streams
    finally:
        await nc.close()
        await svc.svc.close()


async def test_a_stop_string_inside_a_multi_token_step_ends_where_one_token_steps_do(
    nats_server, tiny_llama, monkeypatch
):
    """Speculation brings several tokens a step: a stop string completed by one of them ends
    the stream at that token, logprobs, usage and token record alike, as a step per token
    does (the tokens after it were counted and their logprobs sent)."""
    tok = Tokenizer.from_folder(tiny_llama)
    ids = tok.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)

    async def run(per_step: int) -> tuple[str, int, int, list[int]]:
        svc = DetokenizerService(DetokenizerConfig(MeshConfig(nats_server.url), str(tiny_llama)))
        await svc.svc.connect()  # (for max_payload; what it sends is caught below)
        sent: list[object] = []

        async def publish(subject: str, message: object, *args, **kwargs) -> None:
            sent.append(message)

        monkeypatch.setattr(svc.svc, "publish", publish)
        for i in range(0, len(ids), per_step):
            chunk = ids[i : i + per_step]
            start = StreamStart(["fox jum"], True, 3, 0, reply_to="inbox") if i == 0 else None
            done = "length" if i + per_step >= len(ids) else None
            logprobs = [WireTokenLogprob(t, -0.5) for t in chunk]
            seq = SeqTokens("r", chunk, done, min(i + per_step, len(ids)), start, logprobs)
            await svc.on_step(StepTokens("ex", [seq]))
        texts = [TextDeltas.decode(m) for m in sent if isinstance(m, bytes)]  # (as encoded)
        deltas = [d for m in texts for d in m.deltas]
        assert deltas[-1].finish_reason == "stop" and deltas[-1].usage is not None
        text = "".join(d.text for d in deltas)
        count = sum(len(d.logprobs or []) for d in deltas)
        record = [t for d in deltas for t in d.token_ids]
        await svc.svc.close()
        return text, count, deltas[-1].usage.completion_tokens, record

    one = await run(1)
    assert one[0] == "The quick brown " and one[1] == one[2] == len(one[3]) < len(ids)
    assert await run(4) == one
    assert await run(3) == one


@pytest.fixture(scope="module")
def spm_like(tmp_path_factory: pytest.TempPathFactory, tiny_llama):
    """A model folder (the tiny model's config) with a Llama-2 style tokenizer, whose decoder
    strips the first token's leading space."""
    folder = tmp_path_factory.mktemp("spm")
    shutil.copy(tiny_llama / "config.json", folder)
    return write_tokenizer_folder(folder, train_sentencepiece_like(), bos="<s>", eos="</s>")


async def deltas_of(
    nats_url: str, model, monkeypatch, seqs: list[SeqTokens], others: list[object] | None = None
) -> list[TextDelta]:
    """Every delta a fresh detokenizer shard sends for ``seqs``, one step each; what else it
    publishes (aborts) goes to ``others``."""
    svc = DetokenizerService(DetokenizerConfig(MeshConfig(nats_url), str(model)))
    await svc.svc.connect()
    sent: list[bytes] = []

    async def publish(subject: str, message: object, *args, **kwargs) -> None:
        if isinstance(message, bytes):  # the deltas (encoded); an abort goes out as is
            sent.append(message)
        elif others is not None:
            others.append(message)

    monkeypatch.setattr(svc.svc, "publish", publish)
    try:
        for seq in seqs:
            await svc.on_step(StepTokens("ex", [seq]))
    finally:
        await svc.svc.close()
    return [d for m in sent for d in TextDeltas.decode(m).deltas]


async def test_the_first_token_reads_as_it_does_after_the_prompt(
    nats_server, spm_like, monkeypatch
):
    """On a SentencePiece tokenizer the detokenizer decoded a stream from its first token
    alone, and the decoder strips that token's leading space: "The cat" + "▁sat ▁on ..."
    came out "sat on ...", where the completion (and vLLM) reads " sat on ...". Logprobs'
    tokens were decoded one by one the same way: "▁the" and "the" both read "the", so a
    top_logprobs map lost one of them."""
    tok = Tokenizer.from_folder(spm_like)
    prompt = tok.encode("The quick brown", add_special_tokens=False)
    generated = tok.encode("fox jumps over the lazy dog", add_special_tokens=False)
    expected = tok.decode(prompt + generated)[len(tok.decode(prompt)) :]
    assert expected == " fox jumps over the lazy dog"
    assert tok.decode(generated) == expected[1:]
    vocab = Backend.from_file(str(spm_like / "tokenizer.json"))
    spaced, bare = vocab.token_to_id("▁t"), vocab.token_to_id("t")
    assert spaced is not None and bare is not None
    assert tok.decode([spaced]) == tok.decode([bare]) == "t"

    seqs = []
    for i, token in enumerate(generated):
        start = None
        if i == 0:
            start = StreamStart([], True, len(prompt), 0, reply_to="inbox",
                                prompt_tail=prompt[-PROMPT_TAIL_TOKENS:])  # fmt: skip
        done = "length" if i == len(generated) - 1 else None
        logprobs = [WireTokenLogprob(token, -0.1, [(spaced, -1.0), (bare, -2.0)])]
        seqs.append(SeqTokens("r", [token], done, i + 1, start, logprobs))
    deltas = await deltas_of(nats_server.url, spm_like, monkeypatch, seqs)
    assert "".join(d.text for d in deltas) == expected
    entries = [e for d in deltas for e in d.logprobs or []]
    assert "".join(e.token for e in entries) == expected
    assert all(dict(e.top) == {" t": -1.0, "t": -2.0} for e in entries)


async def test_the_stop_token_that_ends_a_stream_has_no_text(nats_server, tiny_llama, monkeypatch):
    """An EOS with skip_special_tokens off (or a stop_token_ids entry that is plain text)
    ended the stream with its text in the completion ("...<|im_end|>"); vLLM leaves the stop
    token's text out, and keeps its id, count and logprob. A stream that ends by length, or
    whose last token is no stop token (a grammar completed), keeps every token's text."""
    tok = Tokenizer.from_folder(tiny_llama)
    words = tok.encode("Hello world", add_special_tokens=False)
    end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(end) == 1 and tok.decode(end, skip_special_tokens=False) == "<|im_end|>"

    async def run(ids: list[int], stop_token: bool, finish: str) -> TextDelta:
        start = StreamStart([], False, 3, 0, reply_to="inbox")
        lps = [WireTokenLogprob(t, -0.5) for t in ids]
        seq = SeqTokens("r", ids, finish, len(ids), start, lps, stop_token=stop_token)
        others: list[object] = []
        (delta,) = await deltas_of(nats_server.url, tiny_llama, monkeypatch, [seq], others)
        assert others == []  # only the delta was published
        return delta

    stopped = await run([*words, *end], True, "stop")
    assert stopped.text == "Hello world" and stopped.finish_reason == "stop"
    assert stopped.token_ids == [*words, *end]
    assert stopped.usage is not None and stopped.usage.completion_tokens == len(words) + 1
    assert stopped.logprobs is not None and stopped.logprobs[-1].token == "<|im_end|>"
    kept = await run([*words, *end], False, "stop")
    assert kept.text == "Hello world<|im_end|>"
    alone = await run(end, True, "stop")  # the first token already ends it
    assert alone.text == "" and alone.token_ids == end


@pytest.mark.parametrize("per_step", [1, 4])
async def test_min_tokens_and_include_stop_str_in_output(
    nats_server, tiny_llama, monkeypatch, per_step
):
    """vLLM's min_tokens: a stop string completed within the first min_tokens tokens does not
    end the stream (the sampler keeps stop tokens out meanwhile); one after does.
    include_stop_str_in_output: the stop string, and a stop token's text, stay."""
    tok = Tokenizer.from_folder(tiny_llama)
    ids = tok.encode("one two one two one", add_special_tokens=False)
    upto_first = len(tok.encode("one two", add_special_tokens=False))

    async def text(min_tokens: int, include: bool = False, stop: str = "two") -> str:
        start = StreamStart([stop], True, 3, 0, reply_to="inbox", min_tokens=min_tokens,
                            include_stop_str_in_output=include)  # fmt: skip
        seqs = []
        for i in range(0, len(ids), per_step):
            done = "length" if i + per_step >= len(ids) else None
            chunk = ids[i : i + per_step]
            seqs.append(SeqTokens("r", chunk, done, i + len(chunk), start if i == 0 else None))
        deltas = await deltas_of(nats_server.url, tiny_llama, monkeypatch, seqs)
        assert deltas[-1].finish_reason == ("stop" if stop in "one two one two one" else "length")
        return "".join(d.text for d in deltas)

    assert await text(0) == "one "
    assert await text(upto_first) == "one two one "  # the first "two" is within min_tokens
    assert await text(0, include=True) == "one two"
    assert await text(upto_first, include=True) == "one two one two"
    end = tok.encode("<|im_end|>", add_special_tokens=False)
    start = StreamStart([], False, 3, 0, reply_to="inbox", include_stop_str_in_output=True)
    seq = SeqTokens("r", [*ids, *end], "stop", len(ids) + 1, start, stop_token=True)
    (delta,) = await deltas_of(nats_server.url, tiny_llama, monkeypatch, [seq])
    assert delta.text == "one two one two one<|im_end|>"  # the stop token's text stays
