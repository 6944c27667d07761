"""vLLM's /tokenize and /detokenize through the mesh: the tokenizer service's own encoding of a
prompt or of messages under the chat template, as a request's; their 4xx; the API key."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.tokenizer import Tokenizer
from tests.mesh import MeshHarness

BAD_ROLE = "messages[0].role"


@pytest.fixture(scope="module")
def mesh(tiny_llama: Path):
    harness = MeshHarness(tiny_llama, gateway_options={"api_keys": ("k1",)}).start()
    yield harness
    harness.stop()


async def post(mesh: MeshHarness, path: str, body: Any, key: str | None = "k1") -> tuple[int, Any]:
    url = mesh.base_url.removesuffix("/v1") + path
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers) as resp,
    ):
        return resp.status, await resp.json()


async def test_tokenize_a_prompt_and_messages_as_requests_are(mesh, tiny_llama) -> None:
    tok = Tokenizer.from_folder(tiny_llama)
    prompt = "The quick brown fox, café 你好"
    status, out = await post(mesh, "/tokenize", {"model": "tiny", "prompt": prompt})
    assert status == 200 and out["tokens"] == tok.encode(prompt)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256
    assert out["token_strs"] is None
    plain = {"prompt": prompt, "add_special_tokens": False, "return_token_strs": True}
    status, out = await post(mesh, "/tokenize", plain)
    assert out["tokens"] == tok.encode(prompt, add_special_tokens=False)
    assert out["token_strs"] == [tok.id_to_token(t) for t in out["tokens"]]

    messages = [{"role": "user", "content": "Tell me about batching"}]
    status, out = await post(mesh, "/tokenize", {"messages": messages})
    rendered = tok.apply_chat_template(messages)
    assert status == 200 and out["tokens"] == tok.encode(rendered, add_special_tokens=False)
    status, out = await post(
        mesh, "/tokenize", {"messages": messages, "add_generation_prompt": False}
    )
    unprompted = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert out["tokens"] == tok.encode(unprompted, add_special_tokens=False)

    status, back = await post(mesh, "/detokenize", {"model": "tiny", "tokens": out["tokens"]})
    assert status == 200
    assert back == {"prompt": tok.decode(out["tokens"], skip_special_tokens=False)}


@pytest.mark.parametrize(
    ("path", "body", "key", "status", "param"),
    [
        ("/tokenize", {"prompt": "x"}, None, 401, None),
        ("/detokenize", {"tokens": [1]}, "nope", 401, None),
        ("/tokenize", {"prompt": 5}, "k1", 400, "prompt"),
        ("/tokenize", {}, "k1", 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "k1", 404, "model"),
        ("/tokenize", {"messages": [{"role": "bot", "content": ""}]}, "k1", 400, BAD_ROLE),
        ("/detokenize", {"tokens": [1, -2]}, "k1", 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "k1", 400, "tokens"),  # past the vocabulary
    ],
)
async def test_bad_questions_are_openai_errors(mesh, path, body, key, status, param) -> None:
    got, out = await post(mesh, path, body, key)
    assert got == status and out["error"]["message"] and out["error"]["param"] == param
    ok, _ = await post(mesh, "/tokenize", {"prompt": "still serving"})
    assert ok == 200


async def test_what_the_bus_cannot_carry_is_a_413_at_once(mesh) -> None:
    """A question over the bus's 1 MiB, or an answer over it (every token's string of a long
    prompt): a 413 the client should not retry, not a 503 after the timeout."""
    status, out = await post(mesh, "/tokenize", {"prompt": "a " * 1_200_000})
    assert status == 413 and out["error"]["code"] == "request_too_large"
    started = time.monotonic()
    body = {"prompt": "a b c d e f " * 60_000, "return_token_strs": True}
    status, out = await post(mesh, "/tokenize", body)
    assert status == 413 and out["error"]["code"] == "response_too_large"
    assert time.monotonic() - started < 5
