"""The whole mesh (real nats-server, every service, tiny model) through the OpenAI client."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import openai
import pytest

from common.tokenizer import Tokenizer
from gpu.engine import Engine, EngineConfig
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from services.gateway.mesh_client import MeshClient
from services.tokenizer.service import TokenizerService, bad_words_token_ids
from tests.mesh import MeshHarness, openai_client

PROMPTS = ["Hello world", "The quick brown fox", "Serving language models", "café 你好"]


@pytest.fixture(scope="module")
def mesh(tiny_llama):
    harness = MeshHarness(tiny_llama, executors=2, kv_cache_tokens=2048).start()
    yield harness
    harness.stop()


@pytest.fixture(scope="module")
def offline(tiny_llama):
    """The in-process engine and tokenizer: what the mesh must reproduce at temperature 0."""
    tok = Tokenizer.from_folder(tiny_llama)
    engine = Engine(
        ModelRunner(load_model(tiny_llama, progress=False), 256, 16),
        EngineConfig(),
        tok.eos_token_ids,
    )

    def greedy(prompt_ids: list[int], max_tokens: int, **params: Any) -> str:
        out = engine.generate(
            [prompt_ids], SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
        )
        return tok.decode(out[0])

    return tok, greedy


@pytest.fixture
async def client(mesh):
    async with openai_client(mesh.base_url) as c:
        yield c


async def stream_text(client, **kwargs):
    chunks = [c async for c in await client.completions.create(stream=True, **kwargs)]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks


async def test_completion_equals_offline_greedy(client, offline):
    tok, greedy = offline
    for prompt in PROMPTS:
        expected = greedy(tok.encode(prompt), 12)
        full = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0
        )
        streamed, chunks = await stream_text(
            client, model="tiny", prompt=prompt, max_tokens=12, temperature=0
        )
        assert full.choices[0].text == expected == streamed
        assert "\ufffd" not in streamed or "\ufffd" in expected
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


async def test_chat_equals_offline_greedy(client, offline):
    tok, greedy = offline
    messages = [{"role": "user", "content": "Tell me about batching"}]
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    expected = greedy(ids, 10)
    full = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0
    )
    assert full.choices[0].message.content == expected
    assert full.choices[0].message.role == "assistant"
    stream = await client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == len(ids)
    assert usage.completion_tokens == full.usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and all(f is None for f in finishes[:-1])


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_continuous_usage_stats_give_the_usage_so_far_on_every_chunk(client, kind):
    """vLLM's ``stream_options.continuous_usage_stats``: it was ignored (usage null until the
    last chunk). Two choices: their tokens add up, the prompt is counted once."""
    common = dict(
        model="tiny",
        max_tokens=6,
        n=2,
        temperature=1.0,
        seed=3,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    if kind == "chat":
        messages = [{"role": "user", "content": "Count"}]
        stream = await client.chat.completions.create(messages=messages, **common)
    else:
        stream = await client.completions.create(prompt="Count to ten", **common)
    chunks = [c async for c in stream]
    final = chunks[-1].usage
    assert chunks[-1].choices == [] and final.completion_tokens == 12
    usages = [c.usage for c in chunks]
    assert all(u is not None and u.prompt_tokens == final.prompt_tokens > 0 for u in usages)
    generated = [u.completion_tokens for u in usages]
    assert generated == sorted(generated) and generated[-2:] == [12, 12]
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    if kind == "chat":  # the role chunks open each choice before anything is generated
        assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant"] * 2
        assert generated[:2] == [0, 0]
    # without include_usage it is off, as in vLLM
    del common["stream_options"]
    stream = await client.completions.create(
        prompt="Count", stream_options={"continuous_usage_stats": True}, **common
    )
    assert [c.usage async for c in stream if c.usage is not None] == []


async def test_n_seed_and_logprobs(client):
    kwargs = dict(
        model="tiny",
        prompt="Hello",
        max_tokens=8,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    a = await client.completions.create(n=2, **kwargs)
    b = await client.completions.create(n=2, **kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # choices are sampled independently
    assert a.usage.completion_tokens == 16  # both choices are counted
    lp = await client.completions.create(
        model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=3
    )
    info = lp.choices[0].logprobs
    assert len(info.tokens) == len(info.token_logprobs) == lp.usage.completion_tokens
    assert all(v <= 0 for v in info.token_logprobs)
    assert all(len(top) >= 1 for top in info.top_logprobs)


async def test_vllm_allowed_token_ids_bad_words_and_truncation(client, offline):
    """vLLM's allowed_token_ids, bad_words (encoded by the tokenizer as vLLM encodes them) and
    truncate_prompt_tokens through the mesh give what the engine gives with the same settings,
    and each changes the output it is meant to change."""
    tok, greedy = offline
    prompt = "The quick brown fox"
    ids = tok.encode(prompt)
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    free = greedy(ids, 8, ignore_eos=True)
    free_ids = tok.encode(free, add_special_tokens=False)
    allowed = sorted({tok.encode(w, add_special_tokens=False)[0] for w in ("a", " the", "x")})
    only = await client.completions.create(
        **kwargs, extra_body={"allowed_token_ids": allowed, "ignore_eos": True}
    )
    expected = greedy(ids, 8, ignore_eos=True, allowed_token_ids=tuple(allowed))
    assert only.choices[0].text == expected != free
    assert set(tok.encode(expected, add_special_tokens=False)) <= set(allowed)

    word = tok.decode(free_ids[:1])  # the free run's first token, as text
    banned = bad_words_token_ids(tok, [word])
    avoided = await client.completions.create(
        **kwargs, extra_body={"bad_words": [word], "ignore_eos": True}
    )
    expected = greedy(ids, 8, ignore_eos=True, bad_words_token_ids=banned)
    assert avoided.choices[0].text == expected and not expected.startswith(word)

    cut = await client.completions.create(**kwargs, extra_body={"truncate_prompt_tokens": 2})
    assert cut.usage.prompt_tokens == 2
    assert cut.choices[0].text == greedy(ids[-2:], 8)


async def test_a_batch_of_prompts_is_one_request_per_prompt(mesh, client, offline, monkeypatch):
    """OpenAI's batched prompts (strings or token ids): prompt k's n choices are k * n ...,
    each what the prompt alone gives; the usage sums the prompts; streamed alike; echo gives
    each choice its own prompt; one bad prompt fails the batch with nothing left running."""
    tok, greedy = offline
    prompts = ["Hello world", "The quick brown fox", "café 你好"]
    kwargs: dict[str, Any] = {
        "model": "tiny", "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}
    }  # fmt: skip
    out = await client.completions.create(prompt=prompts, n=2, **kwargs)
    expected = [greedy(tok.encode(p), 6, ignore_eos=True) for p in prompts]
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [e for e in expected for _ in range(2)]
    assert out.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 6 * 6

    by_ids = [tok.encode(p) for p in prompts]
    stream = await client.completions.create(prompt=by_ids, stream=True, echo=True, **kwargs)
    texts = [""] * 3
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [tok.decode(ids) + e for ids, e in zip(by_ids, expected, strict=True)]

    aborted: list[list[str]] = []
    publish_abort = MeshClient._publish_abort

    async def spy(self: MeshClient, request_ids: list[str], reason: str) -> None:
        aborted.append(list(request_ids))
        await publish_abort(self, request_ids, reason)

    monkeypatch.setattr(MeshClient, "_publish_abort", spy)
    with pytest.raises(openai.BadRequestError):  # the second prompt is past the context
        await client.completions.create(prompt=["hi", "word " * 400], **kwargs)
    # every choice of both prompts is aborted (the first may be generating)
    assert sorted(rid.rsplit("-", 2)[-2:][0] for ids in aborted for rid in ids) == ["0", "1"]
    for _ in range(100):
        if not any(e.engine.has_unfinished() for e in mesh.executor_services):
            break
        await asyncio.sleep(0.05)
    for ex in mesh.executor_services:
        assert not ex.engine.has_unfinished()
        assert ex.engine.pages.num_free == ex.engine.pages.num_pages
    ok = await client.completions.create(prompt="still alive", max_tokens=2, model="tiny")
    assert ok.choices[0].finish_reason in ("stop", "length")


async def test_n_choices_share_one_encode(mesh, client, monkeypatch):
    """The tokenizer encodes the prompt once for n choices; choice i samples with seed + i (as
    one request with that seed would), and greedy choices are all equal."""
    tok = next(s for s in mesh.services if isinstance(s, TokenizerService))
    calls = []
    encode = tok.tokenizer.encode

    def counting(*args, **kwargs):
        calls.append(args)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tok.tokenizer, "encode", counting)
    kwargs = dict(model="tiny", prompt="Choices fan out", max_tokens=8)
    kwargs["extra_body"] = {"ignore_eos": True}
    sampled = await client.completions.create(n=3, temperature=1.0, seed=11, **kwargs)
    assert len(calls) == 1
    texts = [c.text for c in sorted(sampled.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3, texts  # each choice draws its own tokens
    assert sampled.usage.completion_tokens == 24
    alone = await client.completions.create(n=1, temperature=1.0, seed=13, **kwargs)
    assert alone.choices[0].text == texts[2]  # choice 2 of seed 11 is seed 13
    greedy = await client.completions.create(n=3, temperature=0, **kwargs)
    assert len(calls) == 3
    assert len({c.text for c in greedy.choices}) == 1
    assert sorted(c.index for c in greedy.choices) == [0, 1, 2]


async def test_stop_string_spanning_tokens_never_reaches_client(client, offline):
    tok, greedy = offline
    prompt = "The quick brown fox"
    ids = tok.encode(prompt)
    # find a stop string that spans a token boundary in the greedy continuation
    text = greedy(ids, 16)
    visible = text.replace("\ufffd", "")
    assert len(visible) >= 6, "the tiny model should produce some visible text"
    start = max(1, len(visible) // 2 - 2)
    stop = visible[start : start + 3]
    expected = text[: text.index(stop)]
    streamed, chunks = await stream_text(
        client, model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=[stop]
    )
    assert streamed == expected and stop not in streamed
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_64_concurrent_streams(client, offline):
    tok, greedy = offline
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(64)]
    expected = [greedy(tok.encode(p), 6) for p in prompts]
    results = await asyncio.gather(
        *(stream_text(client, model="tiny", prompt=p, max_tokens=6, temperature=0) for p in prompts)
    )
    assert [r[0] for r in results] == expected


async def test_requests_spread_over_two_executors(client, mesh):
    # Routing goes by the last heartbeat: wait until both report the previous test's load gone
    # (a stale busy heartbeat would rightly send everything to the other executor).
    sched = next(s for s in mesh.services if type(s).__name__ == "SchedulerService")
    async with asyncio.timeout(10):
        while len(sched.router.executors) < 2 or any(
            st.heartbeat.running or st.heartbeat.waiting or st.heartbeat.pending_tokens
            for st in sched.router.executors.values()
        ):
            await asyncio.sleep(0.05)
    before = [e.engine.num_steps for e in mesh.executor_services]
    await asyncio.gather(
        *(
            client.completions.create(model="tiny", prompt=f"spread {i}", max_tokens=8)
            for i in range(16)
        )
    )
    after = [e.engine.num_steps for e in mesh.executor_services]
    assert all(a > b for a, b in zip(after, before)), (before, after)


async def test_disconnect_frees_sequence_and_pages(mesh):
    url = mesh.base_url + "/completions"
    body = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url, json=body)
        await resp.content.readline()  # the stream has started
        resp.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        busy = [e for e in mesh.executor_services if e.engine.has_unfinished()]
        if not busy:
            break
        await asyncio.sleep(0.05)
    for ex in mesh.executor_services:
        assert not ex.engine.has_unfinished()
        assert ex.engine.pages.num_free == ex.engine.pages.num_pages


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": "tiny"}, 400, "prompt"),
        ({"model": "tiny", "prompt": "x", "temperature": 5}, 400, "temperature"),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"model": "tiny", "prompt": "word " * 400, "max_tokens": 4}, 400, "prompt"),
    ],
)
async def test_bad_input_gets_openai_errors_and_mesh_keeps_serving(
    mesh, client, body, status, param
):
    async with aiohttp.ClientSession() as session:
        async with session.post(mesh.base_url + "/completions", json=body) as resp:
            assert resp.status == status
            err = (await resp.json())["error"]
            assert err["message"] and err["type"] and err.get("param") == param
        async with session.post(
            mesh.base_url + "/completions",
            data=b"{not json",
            headers={"Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 400
            assert "error" in json.loads(await resp.text())
    ok = await client.completions.create(model="tiny", prompt="still alive", max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


async def test_max_tokens_past_the_context_is_a_400_and_a_chat_default_is_cut_to_fit(client):
    """As vLLM: a max_tokens the client chose that the context cannot hold after the prompt
    is a 400 (it was cut silently for a text prompt, and the client got fewer tokens than it
    asked for with finish_reason "length"); a chat request that sets none gets what fits."""
    prompt = "Serving language models at scale " * 4  # ~30 tokens of a 256-token context
    for create, kwargs in (
        (client.completions.create, {"prompt": prompt}),
        (client.chat.completions.create, {"messages": [{"role": "user", "content": prompt}]}),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            await create(model="tiny", max_tokens=250, **kwargs)
        error: Any = info.value.body
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
        assert "maximum context length is 256 tokens" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:  # a chat default cannot hold these
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            extra_body={"min_tokens": 250},
        )
    error = info.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "min_tokens"
    reply = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 256
