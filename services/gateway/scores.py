"""vLLM's score and rerank APIs for an embedding model (a bi-encoder): each text is embedded
once through the mesh (``services.gateway.embeddings``), and a pair's score is the cosine
similarity of its two vectors, as vLLM scores with embedding models.

- ``/score`` (``/v1/score``): ``text_1`` and ``text_2``, each a string or a list of strings,
  paired 1:1, 1:N (the one ``text_1`` against each ``text_2``) or N:N; ``data[i].score``.
- ``/rerank`` (``/v1/rerank``, ``/v2/rerank``; Jina's and Cohere's shape): ``query`` and
  ``documents``; the results sorted by ``relevance_score``, highest first, the first
  ``top_n`` of them (0: all), each with its document's index and text.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.wire.detokenizer import float32_values
from services.gateway.body import Body, bad_request, unicode_text, wrong_type
from services.gateway.config import GatewayConfig
from services.gateway.embeddings import Embedded, EmbeddingRequest, embed_inputs
from services.gateway.mesh_client import MeshClient
from services.gateway.protocol import (
    MAX_INT,
    adapter_of,
    parse_model,
    parse_priority,
    parse_truncation,
)


@dataclass(frozen=True)
class ScoreRequest:
    """Pairs of texts to score: ``firsts[i]`` with ``seconds[i]``, or the one first text with
    every second one."""

    model: str
    firsts: list[str]
    seconds: list[str]
    priority: int = 0
    truncate_prompt_tokens: int | None = None
    lora: str = ""
    top_n: int = 0  # rerank: how many results (0: all)
    names: tuple[str, ...] = ()  # each text's field, for errors ("text_2[3]")
    return_documents: bool = True  # rerank: each result with its document's text

    @property
    def texts(self) -> list[str]:
        return self.firsts + self.seconds

    def embedding_request(self) -> EmbeddingRequest:
        return EmbeddingRequest(
            model=self.model,
            inputs=[(text, None) for text in self.texts],
            priority=self.priority,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            lora=self.lora,
            names=self.names,
        )


def texts(body: Body, name: str, limit: int, one_only: bool = False) -> list[str]:
    """A required string, or (unless ``one_only``) a non-empty list of them."""
    value = body.get(name)
    if value is None:
        raise bad_request(f"Missing required parameter: '{name}'.", name, "missing_required")
    values = [value] if isinstance(value, str) or one_only else value
    if not isinstance(values, list) or not values:
        expected = "a string" if one_only else "a string or a non-empty array of strings"
        raise wrong_type(name, expected, value)
    if len(values) > limit:
        raise bad_request(f"'{name}' may hold at most {limit} texts, got {len(values)}.", name)
    out = []
    for i, text in enumerate(values):
        where = name if isinstance(value, str) or one_only else f"{name}[{i}]"
        if not isinstance(text, str):
            raise wrong_type(where, "a string", text)
        if not text:
            raise bad_request(f"'{where}' must not be an empty string.", where, "invalid_value")
        out.append(unicode_text(text, where))
    return out


def common(
    body: Body,
    config: GatewayConfig,
    firsts: list[str],
    seconds: list[str],
    fields: tuple[str, str],
) -> ScoreRequest:
    model = parse_model(body, config)
    if len(firsts) + len(seconds) > config.max_embedding_inputs:
        raise bad_request(
            f"The request holds {len(firsts) + len(seconds)} texts; at most "
            f"{config.max_embedding_inputs} (--max-embedding-inputs).",
            fields[1],
        )
    names = []  # (a list of one is still named by index)
    for field, texts_of in zip(fields, (firsts, seconds), strict=True):
        one = isinstance(body.get(field), str)
        names += [field if one else f"{field}[{i}]" for i in range(len(texts_of))]
    return ScoreRequest(
        model=model,
        firsts=firsts,
        seconds=seconds,
        names=tuple(names),
        priority=parse_priority(body, config.max_client_priority),
        truncate_prompt_tokens=parse_truncation(body, config),
        lora=adapter_of(model, config),
    )


def parse_score(raw: Any, config: GatewayConfig) -> ScoreRequest:
    body = Body(raw)
    firsts = texts(body, "text_1", config.max_embedding_inputs)
    seconds = texts(body, "text_2", config.max_embedding_inputs)
    if len(firsts) not in (1, len(seconds)):
        raise bad_request(
            f"'text_1' and 'text_2' pair 1:1, 1:N or N:N; got {len(firsts)}:{len(seconds)}.",
            "text_1",
            "invalid_value",
        )
    return common(body, config, firsts, seconds, ("text_1", "text_2"))


def parse_rerank(raw: Any, config: GatewayConfig) -> ScoreRequest:
    body = Body(raw)
    query = texts(body, "query", 1, one_only=True)
    documents = texts(body, "documents", config.max_embedding_inputs)
    if isinstance(body.get("documents"), str):
        raise wrong_type("documents", "an array of strings", body.get("documents"))
    top_n = body.integer("top_n", 0, 0, MAX_INT)
    ask = common(body, config, query, documents, ("query", "documents"))
    # (Cohere's return_documents; vLLM always returns them, as the default here)
    return dataclasses.replace(
        ask, top_n=top_n, return_documents=body.boolean("return_documents", True)
    )


async def score(
    mesh: MeshClient, ask: ScoreRequest, response_id: str, concurrency: int
) -> dict[str, Any]:
    """vLLM's ``/score`` response."""
    scores, tokens = await score_pairs(mesh, ask, response_id, concurrency)
    return score_response(ask, response_id, scores, tokens)


async def rerank(
    mesh: MeshClient, ask: ScoreRequest, response_id: str, concurrency: int
) -> dict[str, Any]:
    """vLLM's ``/rerank`` response."""
    scores, tokens = await score_pairs(mesh, ask, response_id, concurrency)
    return rerank_response(ask, response_id, scores, tokens)


async def score_pairs(
    mesh: MeshClient, ask: ScoreRequest, response_id: str, concurrency: int
) -> tuple[list[float], int]:
    """Each pair's cosine similarity, and the prompt tokens of every text embedded."""
    embedded = await embed_inputs(mesh, ask.embedding_request(), response_id, concurrency)
    scores = cosines(embedded[: len(ask.firsts)], embedded[len(ask.firsts) :])
    return scores, sum(e.prompt_tokens for e in embedded)


def cosines(firsts: list[Embedded], seconds: list[Embedded]) -> list[float]:
    """Each pair's cosine similarity (one first against every second, or pairwise), in
    numpy: 2,048 vectors of 4,096 take milliseconds, not the event loop's seconds."""
    a, b = unit_rows(firsts), unit_rows(seconds)
    return [float(v) for v in (a * b).sum(axis=1)]  # (a of one row broadcasts)


def unit_rows(embedded: list[Embedded]) -> np.ndarray:
    rows = np.stack([np.asarray(float32_values(e.vector)) for e in embedded]).astype(np.float64)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    unit: np.ndarray = np.divide(rows, norms, out=np.zeros_like(rows), where=norms > 0)
    return unit


def score_response(
    ask: ScoreRequest, response_id: str, scores: list[float], tokens: int
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "list",
        "created": int(time.time()),
        "model": ask.model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def rerank_response(
    ask: ScoreRequest, response_id: str, scores: list[float], tokens: int
) -> dict[str, Any]:
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # (stable: ties keep order)
    chosen = order[: ask.top_n] if ask.top_n > 0 else order
    return {
        "id": response_id,
        "model": ask.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": [
            {"index": i, "relevance_score": scores[i]}
            | ({"document": {"text": ask.seconds[i]}} if ask.return_documents else {})
            for i in chosen
        ],
    }
