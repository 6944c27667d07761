"""Completions' echo and vLLM's prompt_logprobs through the whole mesh: the prompt's text and
logprobs as vLLM shapes them (lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1),
values held to transformers, streamed and not, and their 400s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from common.tokenizer import Tokenizer
from services.tokenizer import service as tokenizer_service
from tests.mesh import MeshHarness, metric_value, openai_client
from tests.models import hf_model

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def mesh(tiny_llama: Path):
    harness = MeshHarness(tiny_llama).start()
    yield harness
    harness.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> tuple[Tokenizer, Any]:
    """The tokenizer, and the prompt logprobs transformers gives ``ids``: ``[P - 1, V]``."""
    tok = Tokenizer.from_folder(tiny_llama)
    model = hf_model(tiny_llama)

    def lsm(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)[:-1]

    return tok, lsm


@pytest.fixture
async def client(mesh: MeshHarness):
    async with openai_client(mesh.base_url) as c:
        yield c


async def test_echo_with_logprobs_is_lm_evals_loglikelihood(client, reference) -> None:
    """echo + logprobs 1 + max_tokens 1: the text starts with the prompt, the logprobs with the
    prompt's tokens (the first has none), each prompt token's logprob is transformers', its top
    map holds it and the top 1; offsets count token characters across prompt and output."""
    tok, lsm = reference
    ids = tok.encode(PROMPT)
    out = await client.completions.create(
        model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    (choice,) = out.choices
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    lp = choice.logprobs
    p = len(ids)
    assert out.usage.prompt_tokens == p and len(lp.tokens) == p + 1
    assert lp.tokens[:p] == [tok.token_text(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = lsm(ids).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    assert lp.token_logprobs[1:p] == pytest.approx(want, abs=2e-4)
    for i in range(1, p + 1):
        assert lp.tokens[i] in lp.top_logprobs[i] and 1 <= len(lp.top_logprobs[i]) <= 2
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(p + 1)]
    extra: Any = choice.model_extra
    assert len(extra["prompt_logprobs"]) == p and extra["prompt_logprobs"][0] is None

    plain = await client.completions.create(
        model="tiny", prompt=PROMPT, logprobs=1, max_tokens=1, temperature=0
    )
    assert choice.text == PROMPT + plain.choices[0].text
    assert lp.token_logprobs[p] == pytest.approx(plain.choices[0].logprobs.token_logprobs[0])
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})


async def test_max_tokens_0_with_echo_scores_the_prompt_alone(mesh, client, reference) -> None:
    """vLLM's prompt-only scoring: the text is the prompt, the logprobs the prompt's, no token
    counted as generated, finish_reason "length"; streamed the same; logprobs up to 20."""
    tok, lsm = reference
    ids = tok.encode(PROMPT)
    kwargs: dict[str, Any] = dict(model="tiny", prompt=PROMPT, echo=True, max_tokens=0)
    metrics = f"{mesh.base_url.removesuffix('/v1')}/metrics"
    generated = metric_value(metrics, GENERATED)
    out = await client.completions.create(logprobs=10, **kwargs)
    (choice,) = out.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.tokens == [tok.token_text(t) for t in ids] and len(lp.top_logprobs[1]) >= 10
    want = lsm(ids).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-4)
    chunks = [c async for c in await client.completions.create(stream=True, **kwargs)]
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert chunks[-1].choices[0].finish_reason == "length"
    # The metrics agree with the responses: no generated token.
    assert metric_value(metrics, GENERATED) == generated


GENERATED = "meshserve:request_generation_tokens_sum"


async def test_echo_streams_the_prompt_first_and_echoes_token_prompts(client, reference) -> None:
    tok, _ = reference
    ids = tok.encode(PROMPT)
    kwargs: dict[str, Any] = dict(model="tiny", echo=True, max_tokens=4, temperature=0)
    full = await client.completions.create(prompt=PROMPT, logprobs=0, **kwargs)
    chunks = [c async for c in await client.completions.create(
        prompt=PROMPT, logprobs=0, stream=True, **kwargs
    )]  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[0].choices[0].text.startswith(PROMPT)
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == full.choices[0].logprobs.tokens
    # A prompt of token ids is echoed decoded (no logprobs asked: none computed or sent).
    by_ids = await client.completions.create(prompt=ids, **kwargs)
    assert by_ids.choices[0].text == tok.decode(ids) + full.choices[0].text[len(PROMPT) :]
    assert by_ids.choices[0].logprobs is None
    assert "prompt_logprobs" not in (by_ids.choices[0].model_extra or {})


async def test_chat_prompt_logprobs_are_vllms_shape(client, reference) -> None:
    tok, lsm = reference
    messages = [{"role": "user", "content": "Tell me about batching"}]
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    out = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    extra: Any = out.model_extra
    entries = extra["prompt_logprobs"]
    assert len(entries) == len(ids) == out.usage.prompt_tokens and entries[0] is None
    ref = lsm(ids)
    for p, entry in enumerate(entries[1:]):
        token = ids[p + 1]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(ref[p, token].item(), abs=2e-4)
        assert own["decoded_token"] == tok.token_text(token) and own["rank"] >= 1
        top = ref[p].topk(2)
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert [e["logprob"] for e in ranked[:2]] == pytest.approx(top.values.tolist(), abs=2e-4)
        assert 2 <= len(entry) <= 3


async def test_zero_with_stream_is_accepted_and_sends_nothing(mesh: MeshHarness) -> None:
    """As vLLM: ``prompt_logprobs: 0`` with ``stream`` is no error, and no chunk carries any."""
    for path, body in (
        ("completions", {"prompt": PROMPT}),
        ("chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    ):
        request = {"model": "tiny", "max_tokens": 3, "stream": True, "prompt_logprobs": 0}
        async with aiohttp.ClientSession() as session:
            url = f"{mesh.base_url}/{path}"
            async with session.post(url, json={**request, **body}) as resp:
                assert resp.status == 200
                raw = (await resp.read()).decode()
        chunks = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
        assert chunks and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert "prompt_logprobs" not in raw and raw.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "echo": True},
            "echo",
        ),
        ("completions", {"prompt": PROMPT, "prompt_logprobs": 20}, "prompt_logprobs"),
        ("completions", {"prompt": PROMPT, "echo": True, "logprobs": 5}, "prompt_logprobs"),
    ],
)
async def test_what_is_refused_is_a_400_naming_it(
    mesh: MeshHarness,
    client,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    body: dict[str, Any],
    param: str,
) -> None:
    """The last two: more entries than one message carries (the bound lowered to 16 here)."""
    monkeypatch.setattr(tokenizer_service, "MAX_PROMPT_LOGPROB_ENTRIES", 16)
    async with aiohttp.ClientSession() as session:
        url = f"{mesh.base_url}/{path}"
        async with session.post(url, json={"model": "tiny", "max_tokens": 1, **body}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
    assert error["param"] == param and error["message"]
    ok = await client.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert ok.choices[0].finish_reason in ("stop", "length")
