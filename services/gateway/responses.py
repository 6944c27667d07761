"""OpenAI response shapes: full responses, SSE chunks, usage, logprobs and error objects.

``ResponseBuilder`` is fed the request's ``TextDelta``s in arrival order; it returns the chunks
to stream for each one and accumulates the full response for the non-streaming path, so both
paths share one formatting of text, finish reasons, usage and logprobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from common.messages import TextDelta, TextLogprob, Usage
from common.runtime import RequestError
from services.gateway.protocol import ApiRequest

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way
DONE = b"data: [DONE]\n\n"

Json = dict[str, Any]


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> Json:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_from(exc: RequestError) -> Json:
    return error_body(str(exc), exc.type, exc.param, exc.code)


def sse(payload: Json) -> bytes:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


def clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def completion_logprobs(entries: list[TextLogprob], text_offset: int) -> Json:
    """The legacy completions format; offsets count token characters, as vLLM does."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [clamp(e.logprob) for e in entries],
        "top_logprobs": [{t: clamp(lp) for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TextLogprob]) -> Json:
    # Top alternatives arrive as text only; their bytes are that text's UTF-8 encoding.
    return {
        "content": [
            {
                "token": e.token,
                "logprob": clamp(e.logprob),
                "bytes": e.token_bytes,
                "top_logprobs": [
                    {"token": t, "logprob": clamp(lp), "bytes": list(t.encode())} for t, lp in e.top
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TextLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    token_chars: int = 0  # characters of the tokens streamed so far (completions text_offset)


class ResponseBuilder:
    def __init__(self, api: ApiRequest, response_id: str, created: int) -> None:
        self.api = api
        self.chat = api.kind == "chat"
        self.head: Json = {
            "id": response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": created,
            "model": api.model,
        }
        self.choices = [Choice() for _ in range(api.n)]

    # --- streaming ---------------------------------------------------------------------------

    def opening_chunks(self) -> list[Json]:
        """Chat streams open each choice with the assistant role, as OpenAI does."""
        if not self.chat:
            return []
        return [
            self.chunk(i, {"delta": {"role": "assistant", "content": ""}})
            for i in range(self.api.n)
        ]

    def add(self, index: int, delta: TextDelta) -> list[Json]:
        """Record ``delta`` for choice ``index``; return the chunks that stream it."""
        choice = self.choices[index]
        chunks = []
        if delta.text or delta.logprobs:
            entries = delta.logprobs or []
            text = delta.text
            content: Json = {"delta": {"content": text}} if self.chat else {"text": text}
            if self.api.params.logprobs is not None:
                content["logprobs"] = self.logprobs(entries, choice.token_chars)
            chunks.append(self.chunk(index, content))
            choice.text.append(delta.text)
            choice.logprobs.extend(entries)
            choice.token_chars += sum(len(e.token) for e in entries)
        if delta.usage is not None:
            choice.usage = delta.usage
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            empty: Json = {"delta": {}} if self.chat else {"text": ""}
            chunks.append(self.chunk(index, {**empty, "finish_reason": delta.finish_reason}))
        return chunks

    def chunk(self, index: int, fields: Json) -> Json:
        choice = {"index": index, "logprobs": None, "finish_reason": None, **fields}
        chunk = {**self.head, "choices": [choice]}
        if self.api.include_usage:
            chunk["usage"] = None  # OpenAI sends null usage on every chunk but the last
        return chunk

    def usage_chunk(self) -> Json:
        return {**self.head, "choices": [], "usage": self.usage()}

    # --- whole responses -----------------------------------------------------------------------

    def usage(self) -> Json:
        """Completion tokens summed over choices; the shared prompt is counted once."""
        reported = [c.usage for c in self.choices if c.usage is not None]
        prompt = reported[0].prompt_tokens if reported else 0
        cached = reported[0].cached_tokens if reported else 0
        completion = sum(u.completion_tokens for u in reported)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def response(self) -> Json:
        choices = []
        for i, choice in enumerate(self.choices):
            text = "".join(choice.text)
            body: Json = (
                {"message": {"role": "assistant", "content": text, "refusal": None}}
                if self.chat
                else {"text": text}
            )
            logprobs = None
            if self.api.params.logprobs is not None:
                logprobs = self.logprobs(choice.logprobs, 0)
            choices.append(
                {"index": i, **body, "logprobs": logprobs, "finish_reason": choice.finish_reason}
            )
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self.head, "object": kind, "choices": choices, "usage": self.usage()}

    def logprobs(self, entries: list[TextLogprob], text_offset: int) -> Json:
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, text_offset)
