"""OpenAI's /v1/embeddings through the whole mesh: the openai client's two encodings, batches
of text and token ids held to transformers' base model pooled as the model's
sentence-transformers files say, Matryoshka sizes, vLLM's normalize, and the 4xx answers;
and the gateway's window over a large batch, with what it aborts when one input fails."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.runtime import RequestError
from common.tokenizer import Tokenizer
from common.wire.detokenizer import float32_bytes
from common.wire.gateway import TextDelta, Usage
from services.gateway.config import GatewayConfig
from services.gateway.embeddings import embed, parse_embedding
from tests.mesh import MeshHarness, metric_value, openai_client
from tests.models import hf_model

TEXTS = ["The quick brown fox", "jumps over the lazy dog", "The quick brown fox"]
ST = "sentence_transformers.models."


@pytest.fixture(scope="module")
def embedder(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a sentence-transformers embedder: mean pooling, normalized,
    Matryoshka."""
    folder = tmp_path_factory.mktemp("embedder") / "model"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    modules = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    (folder / "modules.json").write_text(
        json.dumps([{"idx": i, "path": p, "type": ST + k} for i, (k, p) in enumerate(modules)])
    )
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True})
    )
    return folder


@pytest.fixture(scope="module")
def mesh(embedder: Path):
    harness = MeshHarness(embedder, gateway_options={"max_embedding_inputs": 8}).start()
    yield harness
    harness.stop()


@pytest.fixture(scope="module")
def reference(embedder: Path) -> Any:
    """transformers' mean of the final hidden states of ``ids``, cut and normalized."""
    model = hf_model(embedder)

    def mean(ids: list[int], dims: int | None = None, normalize: bool = True) -> np.ndarray:
        with torch.no_grad():
            vector = model.model(torch.tensor([ids])).last_hidden_state[0].float().mean(0)
        vector = vector[:dims]
        return (F.normalize(vector, dim=0) if normalize else vector).numpy()

    return mean


@pytest.fixture(scope="module")
def tok(embedder: Path) -> Tokenizer:
    return Tokenizer.from_folder(embedder)


@pytest.fixture
async def client(mesh: MeshHarness):
    async with openai_client(mesh.base_url) as c:
        yield c


def close(got: Any, want: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), want, atol=2e-5, rtol=1e-4)


async def post(mesh: MeshHarness, body: dict[str, Any]) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(mesh.base_url + "/embeddings", json=body) as response,
    ):
        return response.status, await response.json()


async def test_the_openai_client_gets_each_inputs_embedding(client, reference, tok) -> None:
    """A batch of texts (the client asks for base64 by default and decodes it), one of them
    twice: each vector is transformers' mean pooled and normalized, in input order; usage
    counts the prompt tokens only."""
    out = await client.embeddings.create(model="tiny", input=TEXTS)
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == "tiny"
    for text, item in zip(TEXTS, out.data, strict=True):
        close(item.embedding, reference(tok.encode(text)))
    tokens = sum(len(tok.encode(t)) for t in TEXTS)
    assert out.usage.prompt_tokens == out.usage.total_tokens == tokens
    assert out.data[0].embedding == out.data[2].embedding


async def test_float_encoding_token_ids_dimensions_and_normalize(mesh, reference, tok) -> None:
    """encoding_format float (numbers that are the float32 values exactly), inputs of token
    ids, a Matryoshka size (cut, then normalized), and vLLM's normalize false."""
    ids = [tok.encode(t) for t in TEXTS[:2]]
    status, body = await post(
        mesh, {"input": ids, "encoding_format": "float", "dimensions": 16, "normalize": False}
    )
    assert status == 200, body
    for one, item in zip(ids, body["data"], strict=True):
        assert len(item["embedding"]) == 16
        close(item["embedding"], reference(one, dims=16, normalize=False))
        exact = np.asarray(item["embedding"], dtype=np.float32)
        assert [float(f"{v:.9g}") for v in exact] == item["embedding"]
    status, body = await post(
        mesh, {"input": TEXTS[0], "dimensions": 8, "encoding_format": "base64"}
    )
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    close(vector, reference(tok.encode(TEXTS[0]), dims=8))
    assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5


@pytest.mark.parametrize(
    ("body", "status", "param", "text"),
    [
        ({}, 400, "input", "Missing required parameter"),
        ({"input": ""}, 400, "input", "must not be an empty string"),
        ({"input": ["a", ""]}, 400, "input[1]", "must not be an empty string"),
        ({"input": ["x"] * 9}, 400, "input", "at most 8"),
        ({"input": "a", "encoding_format": "hex"}, 400, "encoding_format", "float, base64"),
        ({"input": "a", "dimensions": 0}, 400, "dimensions", "between 1"),
        ({"input": "a", "dimensions": 65}, 400, "dimensions", "within 1..64"),
        ({"input": "a", "normalize": "yes"}, 400, "normalize", "boolean"),
        ({"input": "a", "model": "other"}, 404, "model", "does not exist"),
        ({"input": [[5, 10**6]]}, 400, "input", "out of range"),
        ({"input": ["a", "a " * 5000]}, 400, "input[1]", "maximum input length"),
        ({"input": ["a", [5, 6]]}, 400, "input", "not a mix"),
    ],
)
async def test_bad_requests_are_clear_4xx(mesh, body, status, param, text) -> None:
    got, answer = await post(mesh, body)
    assert got == status, answer
    assert answer["error"]["param"] == param and text in answer["error"]["message"]


async def test_a_long_input_truncated_to_the_whole_context(mesh, reference, tok) -> None:
    """truncate_prompt_tokens -1 keeps the input's last tokens that fill the context (256 on
    the tiny model): an embedding needs no room for a token."""
    ids = [5 + (i * 7) % 400 for i in range(300)]
    status, body = await post(mesh, {"input": ids, "truncate_prompt_tokens": -1})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == 256
    close(body["data"][0]["embedding"], reference(ids[-256:]))


async def test_no_generated_token_is_counted_and_the_mesh_serves_on(mesh, client) -> None:
    """The one token each input generates is not the client's: the gateway's generated-token
    count does not move; completions still answer."""
    url = f"http://127.0.0.1:{mesh.port}/metrics"
    before = metric_value(url, "meshserve:request_generation_tokens_sum")
    await client.embeddings.create(model="tiny", input=TEXTS)
    assert metric_value(url, "meshserve:request_generation_tokens_sum") == before
    out = await client.completions.create(model="tiny", prompt="alive?", max_tokens=3)
    assert out.choices[0].finish_reason


async def call(mesh: MeshHarness, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    url = mesh.base_url.removesuffix("/v1") + path
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.json()


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


DOCS = ["the lazy dog sleeps", "a quick brown fox", "jumps over the lazy dog", "fox"]


async def test_score_pairs_1_to_n_and_n_to_n(mesh, reference, tok) -> None:
    """vLLM's /score with an embedding model: each pair's cosine similarity (1:N, N:N)."""
    vectors = {t: reference(tok.encode(t)) for t in [TEXTS[0], *DOCS]}
    status, body = await call(mesh, "/score", {"text_1": TEXTS[0], "text_2": DOCS})
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    for doc, item in zip(DOCS, body["data"], strict=True):
        assert item["object"] == "score"
        assert item["score"] == pytest.approx(cos(vectors[TEXTS[0]], vectors[doc]), abs=1e-5)
    tokens = sum(len(tok.encode(t)) for t in [TEXTS[0], *DOCS])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    status, body = await call(mesh, "/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[2:]})
    want = [cos(vectors[DOCS[0]], vectors[DOCS[2]]), cos(vectors[DOCS[1]], vectors[DOCS[3]])]
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)


async def test_rerank_sorts_the_documents_by_score(mesh, reference, tok) -> None:
    """vLLM's /rerank (Jina's and Cohere's shape): highest first, top_n of them, each with
    its index and text; the same on /v1/rerank and /v2/rerank."""
    query = "where is the fox"
    want = {
        i: cos(reference(tok.encode(query)), reference(tok.encode(d))) for i, d in enumerate(DOCS)
    }
    order = sorted(want, key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, body = await call(mesh, path, {"query": query, "documents": DOCS, "top_n": 3})
        assert status == 200, body
        got = body["results"]
        assert [r["index"] for r in got] == order[:3]
        for r in got:
            assert r["document"] == {"text": DOCS[r["index"]]}
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
    status, body = await call(mesh, "/rerank", {"query": query, "documents": DOCS})
    assert len(body["results"]) == 4 and body["usage"]["total_tokens"] > 0
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"]
    bare = {"query": query, "documents": DOCS, "return_documents": False}
    status, body = await call(mesh, "/rerank", bare)
    assert [set(r) for r in body["results"]] == [{"index", "relevance_score"}] * 4


@pytest.mark.parametrize(
    ("path", "body", "param", "text"),
    [
        ("/score", {"text_2": "a"}, "text_1", "Missing required"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "1:1, 1:N or N:N"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2", "non-empty array"),
        ("/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2[1]", "empty string"),
        ("/score", {"text_1": "a", "text_2": ["b", "a " * 5000]}, "text_2[1]", "maximum input"),
        ("/rerank", {"query": "q", "documents": "d"}, "documents", "array of strings"),
        ("/rerank", {"query": ["q"], "documents": ["d"]}, "query", "a string"),
        ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n", "between 0"),
        ("/rerank", {"query": "q", "documents": ["d"] * 8}, "documents", "at most 8"),
        ("/score", {"text_1": ["a", "b"], "text_2": "c"}, "text_1", "1:1, 1:N or N:N"),
        ("/score", {"text_1": "a", "text_2": "a " * 5000}, "text_2", "maximum input"),
    ],
)  # fmt: skip
async def test_score_and_rerank_bad_requests(mesh, path, body, param, text) -> None:
    status, answer = await call(mesh, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and text in answer["error"]["message"]


# --- the gateway's window, against a stand-in mesh ------------------------------------------


class FakeObserver:
    def __init__(self) -> None:
        self.failed_with: RequestError | None = None

    def failed(self, error: RequestError) -> None:
        self.failed_with = error


class FakeStream:
    def __init__(self, k: int, fail: bool) -> None:
        self.k, self.fail = k, fail
        self.span: Any = None
        self.failure: str | None = None
        self.observer = FakeObserver()

    def __aiter__(self) -> AsyncIterator[tuple[int, TextDelta]]:
        return self.deltas()

    async def deltas(self) -> AsyncIterator[tuple[int, TextDelta]]:
        await asyncio.sleep(0.005 if self.fail else 0.05)
        if self.fail:
            raise RequestError("input 3 is bad", 400, param="prompt")
        vector = float32_bytes([float(self.k), 1.0])
        yield 0, TextDelta("r", "", "length", Usage(self.k + 1, 1), embedding=vector)


class FakeMesh:
    """Submits, counts how many inputs are in the mesh at once, records releases."""

    def __init__(self, fail_at: int | None = None) -> None:
        from opentelemetry import trace

        self.service = type("S", (), {"tracer": trace.get_tracer("test")})()
        self.fail_at = fail_at
        self.open = self.most_open = 0
        self.submitted: list[int] = []
        self.released: list[FakeStream] = []

    async def submit(self, api: Any, request_id: str) -> FakeStream:
        k = int(request_id.rsplit("-", 1)[1])
        self.submitted.append(k)
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        return FakeStream(k, k == self.fail_at)

    async def release(self, stream: FakeStream) -> None:
        self.open -= 1
        self.released.append(stream)


async def test_a_large_batch_goes_through_a_window() -> None:
    config = GatewayConfig(max_embedding_inputs=20)
    ask = parse_embedding(
        {"input": [f"t{k}" for k in range(20)], "encoding_format": "float"}, config
    )
    mesh = FakeMesh()
    body = await embed(mesh, ask, "embd-x", concurrency=3)  # type: ignore[arg-type]
    assert mesh.most_open == 3 and sorted(s.k for s in mesh.released) == list(range(20))
    assert [d["embedding"] for d in body["data"]] == [[float(k), 1.0] for k in range(20)]
    assert body["usage"] == {"prompt_tokens": sum(range(1, 21)), "total_tokens": sum(range(1, 21))}


async def test_one_failed_input_fails_the_request_and_releases_every_other() -> None:
    """Input 3 fails: the request answers its 400, naming the input; every input submitted
    is released (the mesh aborts what still runs) and none is submitted after; those still
    running fail with it (counted so, not as a client that left)."""
    config = GatewayConfig(max_embedding_inputs=20)
    ask = parse_embedding({"input": [f"t{k}" for k in range(20)]}, config)
    mesh = FakeMesh(fail_at=3)
    with pytest.raises(RequestError, match="input 3 is bad") as caught:
        await embed(mesh, ask, "embd-y", concurrency=4)  # type: ignore[arg-type]
    assert caught.value.status == 400 and caught.value.param == "input[3]"
    assert sorted(s.k for s in mesh.released) == sorted(mesh.submitted) and mesh.open == 0
    assert len(mesh.submitted) < 20
    others = [s for s in mesh.released if s.k != 3]
    assert others and all(s.observer.failed_with is caught.value for s in others)
    assert all(s.failure and "another input failed" in s.failure for s in others)
