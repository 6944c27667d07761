"""OpenAI's ``/v1/embeddings``: each input a request through the mesh like a completion's.

An input is encoded by a tokenizer (which puts in the model's own pooling: last token, mean or
CLS, normalized or not, ``gpu.pooler_config``), routed by the scheduler (cached prefixes
count), prefilled by an executor that pools its final hidden states (``gpu.pooling``), and its
vector comes back through a detokenizer with the one token the executor generates (greedy,
never shown, not counted). So embeddings share the mesh's batching, routing, priorities,
LoRA adapters, moves off a lost executor and resumes.

A request batches up to ``--max-embedding-inputs`` inputs (OpenAI's 2048); at most
``--embedding-concurrency`` of them are in the mesh at once, the next sent as one finishes,
so one large batch neither fills the scheduler's queue (429s to everyone) nor holds all of
an executor's slots by itself. The first input that fails fails the request; the rest are
aborted.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from common.runtime import RequestError
from common.telemetry import Attr
from common.wire.detokenizer import float32_values
from common.wire.tokenizer import WireSamplingParams
from services.gateway.body import Body, bad_request, wrong_type
from services.gateway.config import GatewayConfig
from services.gateway.mesh_client import MeshClient
from services.gateway.protocol import (
    MAX_INT,
    ApiRequest,
    adapter_of,
    parse_model,
    parse_priority,
    parse_prompts,
    parse_truncation,
)

ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: list[tuple[str | None, list[int] | None]]  # each as (text, None) or (None, ids)
    encoding_format: str = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # vLLM's; None: as the model's pipeline says
    priority: int = 0
    truncate_prompt_tokens: int | None = None
    lora: str = ""
    names: tuple[str, ...] = ()  # each input's field, for errors (the score APIs'); else input[k]

    def requests(self) -> list[ApiRequest]:
        """One prompt-only request per input: greedy, one token (never shown), pooled."""
        params = WireSamplingParams(
            max_tokens=1,
            temperature=0.0,
            ignore_eos=True,
            pooling="model",
            pooling_dimensions=self.dimensions,
            pooling_normalize=self.normalize,
        )
        return [
            ApiRequest(
                kind="embedding",
                model=self.model,
                n=1,
                stream=False,
                include_usage=False,
                params=params,
                prompt=text,
                prompt_token_ids=ids,
                priority=self.priority,
                max_tokens_chosen=False,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                lora=self.lora,
            )
            for text, ids in self.inputs
        ]


def parse_embedding(raw: Any, config: GatewayConfig) -> EmbeddingRequest:
    body = Body(raw)
    model = parse_model(body, config)
    if body.get("input") is None:
        raise bad_request("Missing required parameter: 'input'.", "input", "missing_required")
    inputs = parse_prompts(body.get("input"), config.max_embedding_inputs, "input")
    if len({text is None for text, _ in inputs}) > 1:  # (as OpenAI and vLLM answer)
        raise bad_request(
            "'input' must be all strings or all arrays of token ids, not a mix.",
            "input",
            "invalid_value",
        )
    for k, (text, _) in enumerate(inputs):
        if text == "":
            where = "input" if len(inputs) == 1 else f"input[{k}]"
            raise bad_request(f"'{where}' must not be an empty string.", where, "invalid_value")
    encoding = body.string("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise bad_request(
            f"'encoding_format' must be one of {', '.join(ENCODINGS)}, got {encoding!r}.",
            "encoding_format",
            "invalid_value",
        )
    normalize = body.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise wrong_type("normalize", "a boolean", normalize)
    if not body.boolean("add_special_tokens", True):  # (vLLM's; its default is what runs)
        raise bad_request(
            "'add_special_tokens': false is not supported.",
            "add_special_tokens",
            "unsupported_parameter",
        )
    body.string("user")  # accepted and ignored, but it must be a string
    return EmbeddingRequest(
        model=model,
        inputs=inputs,
        encoding_format=encoding,
        dimensions=body.optional_integer("dimensions", 1, MAX_INT),
        normalize=normalize,
        priority=parse_priority(body, config.max_client_priority),
        truncate_prompt_tokens=parse_truncation(body, config),
        lora=adapter_of(model, config),
    )


@dataclass
class Embedded:
    vector: bytes
    prompt_tokens: int


async def embed(
    mesh: MeshClient, ask: EmbeddingRequest, response_id: str, concurrency: int
) -> dict[str, Any]:
    """Every input's vector, as OpenAI's response."""
    embedded = await embed_inputs(mesh, ask, response_id, concurrency)
    return embedding_response(ask, response_id, embedded)


async def embed_inputs(
    mesh: MeshClient, ask: EmbeddingRequest, response_id: str, concurrency: int
) -> list[Embedded]:
    """Every input's vector, in input order; ``response_id``'s requests are ``<id>-<k>``."""
    room = asyncio.Semaphore(concurrency)
    tracer = mesh.service.tracer
    results: dict[int, Embedded] = {}
    failed: list[RequestError] = []  # the error of the first input that failed, and so all

    def named(exc: RequestError, k: int) -> RequestError:
        """The tokenizer names the prompt; the client sent an input."""
        if exc.param != "prompt":
            return exc
        where = "input" if len(ask.inputs) == 1 else f"input[{k}]"
        if ask.names:
            where = ask.names[k]
        return RequestError(str(exc), exc.status, exc.type, where, exc.code)

    async def one(k: int, api: ApiRequest) -> None:
        async with room:
            # Each input's own span (its latency, tokens and the mesh's spans below it) under
            # gateway.request, ended when its stream is released.
            span = tracer.start_span("gateway.prompt", attributes={Attr.PROMPT_INDEX: k})
            try:
                with trace.use_span(span):
                    stream = await mesh.submit(api, f"{response_id}-{k}")
            except RequestError as exc:
                span.end()
                failed.append(named(exc, k))
                raise failed[-1] from None
            except BaseException:
                span.end()
                raise
            stream.span = span
            try:
                vector, prompt_tokens = None, 0
                async for _, delta in stream:
                    vector = delta.embedding or vector
                    if delta.usage is not None:
                        prompt_tokens = delta.usage.prompt_tokens
                if vector is None:
                    raise RequestError("The mesh returned no embedding.", 500, "server_error")
                results[k] = Embedded(vector, prompt_tokens)
            except RequestError as exc:
                stream.failure = stream.failure or f"embedding input {k} failed: {exc}"
                failed.append(named(exc, k))
                raise failed[-1] from None
            except asyncio.CancelledError:
                if failed:  # another input failed: this one fails with it (not "client left")
                    if stream.observer is not None:
                        stream.observer.failed(failed[0])
                    stream.failure = stream.failure or f"another input failed: {failed[0]}"
                raise
            finally:
                await mesh.release(stream)

    trace.get_current_span().set_attributes({Attr.REQUEST_ID: response_id, Attr.N: len(ask.inputs)})
    try:
        async with asyncio.TaskGroup() as group:
            for k, api in enumerate(ask.requests()):
                group.create_task(one(k, api))
    except BaseExceptionGroup as group_failed:
        raise (failed[0] if failed else first_failure(group_failed)) from None
    return [results[k] for k in range(len(ask.inputs))]


def first_failure(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """What failed the request where no input's ``RequestError`` did: the first error that is
    not a cancellation (a cancellation if all are)."""
    errors = [e for e in _leaves(group) if not isinstance(e, asyncio.CancelledError)]
    return errors[0] if errors else asyncio.CancelledError()


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


def embedding_response(
    ask: EmbeddingRequest, response_id: str, embedded: list[Embedded]
) -> dict[str, Any]:
    prompt_tokens = sum(e.prompt_tokens for e in embedded)
    return {
        "id": response_id,
        "object": "list",
        "created": int(time.time()),
        "model": ask.model,
        "data": [
            {"object": "embedding", "index": k, "embedding": encoded(e.vector, ask.encoding_format)}
            for k, e in enumerate(embedded)
        ],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def encoded(vector: bytes, encoding: str) -> list[float] | str:
    """OpenAI's two forms: numbers (each float32 written with the 9 significant digits that
    bring it back exactly, not float64's 17), or base64 of the little-endian float32 bytes."""
    if encoding == "base64":
        return base64.b64encode(vector).decode("ascii")
    return [float(f"{v:.9g}") for v in float32_values(vector)]
