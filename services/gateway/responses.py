"""OpenAI response shapes: full responses, SSE chunks, usage, logprobs and error objects.

``ResponseBuilder`` is fed the request's ``TextDelta``s in arrival order; it returns the chunks
to stream for each one and accumulates the full response for the non-streaming path, so both
paths share one formatting of text, finish reasons, usage and logprobs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from common.reasoning import CLOSED, ReasoningSplitter, starts_inside
from common.runtime import RequestError
from common.wire.gateway import TextDelta, TextLogprob, TextPromptLogprobs, Usage
from services.gateway.protocol import ApiRequest
from services.gateway.tool_calls import CallDelta, ToolCallParser

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM (and OpenAI) send this finite floor instead
DONE = b"data: [DONE]\n\n"

Json = dict[str, Any]


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> Json:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_from(exc: RequestError) -> Json:
    return error_body(str(exc), exc.type, exc.param, exc.code)


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by null, which JSON can carry."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dump_json(payload: Any) -> bytes:
    """Strict JSON as UTF-8: what every response body and SSE chunk of the gateway is.

    Python's json writes NaN and Infinity by default, which strict parsers (JavaScript's, Go's,
    pydantic's) reject; here they become null (numbers the gateway formats itself, such as
    logprobs, are made finite before this). Text goes out as UTF-8, not as escapes, unless it
    holds a lone surrogate (JSON input may spell one as an escape, and an error message may
    echo it): that has no UTF-8 form, so that body is written with ASCII escapes instead.
    """
    try:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a non-finite float: the only ValueError these plain payloads raise
        text = json.dumps(
            finite(payload), ensure_ascii=False, separators=(",", ":"), allow_nan=False
        )
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate: written as its escape instead
        return json.dumps(json.loads(text), separators=(",", ":"), allow_nan=False).encode()


def sse(payload: Json) -> bytes:
    return b"data: " + dump_json(payload) + b"\n\n"


def clamp(logprob: float) -> float:
    """A logprob JSON can carry. -inf (an impossible token) and NaN (a sampler whose logits
    overflowed) become the floor; +inf, never a real log-probability, becomes 0.0 (certainty),
    as does a positive value (rounding: no logprob exceeds 0)."""
    if math.isnan(logprob):
        return LOGPROB_FLOOR
    return min(max(logprob, LOGPROB_FLOOR), 0.0)


def completion_logprobs(entries: list[TextLogprob], text_offset: int) -> Json:
    """The legacy completions format; offsets count token characters, as vLLM does. Each
    ``top_logprobs`` map holds the sampled token too ("up to logprobs+1 elements", OpenAI
    says; vLLM does the same), even with ``logprobs: 0``."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [clamp(e.logprob) for e in entries],
        "top_logprobs": [
            {t: clamp(lp) for t, lp in e.top} | {e.token: clamp(e.logprob)} for e in entries
        ],
        "text_offset": offsets,
    }


def echo_logprobs(prompt: TextPromptLogprobs, num_top: int) -> Json:
    """The prompt's part of completions' logprobs under ``echo``, as vLLM gives it: the first
    prompt token has no logprob nor alternatives (null), each other one its own and its top
    ``num_top``; offsets count token characters from the prompt's start."""
    tokens = [prompt.texts[t] for t in prompt.token_ids]
    offsets, chars = [], 0
    for token in tokens:
        offsets.append(chars)
        chars += len(token)
    scored = zip(tokens[1:], prompt.logprobs, prompt.top, strict=True)
    return {
        "tokens": tokens,
        "token_logprobs": [None] + [clamp(lp) for lp in prompt.logprobs],
        "top_logprobs": [None]
        + [
            {prompt.texts[t]: clamp(v) for t, v in top[:num_top]} | {token: clamp(lp)}
            for token, lp, top in scored
        ],
        "text_offset": offsets,
    }


def scored_only(delta: TextDelta) -> TextDelta:
    """A delta of a request that only scores its prompt (echo, max_tokens 0) as its client
    and the metrics see it: the one token generated is not theirs (no text, logprobs or
    token; none counted), and the choice ends with "length"."""
    usage = delta.usage and dataclasses.replace(delta.usage, completion_tokens=0)
    return dataclasses.replace(
        delta,
        text="",
        logprobs=None,
        token_ids=[],
        finish_reason=delta.finish_reason and "length",
        usage=usage,
    )


def joined(head: Json | None, tail: Json) -> Json:
    """Completions' logprobs of the echoed prompt, then of the generated tokens."""
    if head is None:
        return tail
    return {key: head[key] + tail[key] for key in tail}


def prompt_logprobs_json(prompt: TextPromptLogprobs) -> list[Json | None]:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then for each other one a
    map from token id to its logprob, rank and text: the prompt token's own, then its top-N."""
    out: list[Json | None] = [None]
    for token, lp, rank, top in zip(
        prompt.token_ids[1:], prompt.logprobs, prompt.ranks, prompt.top, strict=True
    ):
        entry = {
            str(token): {"logprob": clamp(lp), "rank": rank, "decoded_token": prompt.texts[token]}
        }
        for r, (t, v) in enumerate(top, start=1):
            entry.setdefault(
                str(t), {"logprob": clamp(v), "rank": r, "decoded_token": prompt.texts[t]}
            )
        out.append(entry)
    return out


def chat_logprobs(entries: list[TextLogprob]) -> Json:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": clamp(e.logprob),
                "bytes": e.token_bytes,
                "top_logprobs": [
                    {"token": t, "logprob": clamp(lp), "bytes": raw}
                    for (t, lp), raw in zip(e.top, top_bytes(e), strict=True)
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def top_bytes(entry: TextLogprob) -> list[list[int]]:
    """Each alternative's own bytes (a sender that sent none: its text's)."""
    if len(entry.top_bytes) == len(entry.top):
        return entry.top_bytes
    return [list(t.encode()) for t, _ in entry.top]


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TextLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    token_chars: int = 0  # characters of the tokens streamed so far (completions text_offset)
    tools: ToolCallParser | None = None  # a chat request with tools: calls out of the text
    tokens: int = 0  # generated tokens received so far (the deltas' token_ids)
    prompt: TextPromptLogprobs | None = None  # prompt_logprobs (with the first delta)
    echoed: bool = False  # completions' echo: the prompt's text (and logprobs) went first
    echo_logprobs: Json | None = None  # the prompt's part of the choice's logprobs
    echo_chars: int = 0  # its tokens' characters: where the generated ones' offsets start
    held_logprobs: list[TextLogprob] = field(default_factory=list)  # of held-back tool text
    splitter: ReasoningSplitter | None = None  # a reasoning parser on: <think> out of the text
    reasoning: list[str] = field(default_factory=list)  # the reasoning text so far

    @property
    def completion_tokens(self) -> int:
        """The finished choice's count from its usage; until then what has arrived."""
        if self.finish_reason is not None and self.usage is not None:
            return self.usage.completion_tokens
        return self.tokens


class ResponseBuilder:
    """``tool_format``: the mesh's (the tokenizer announces it); used when the request has
    tools, whose calls are parsed out of the text (``message.tool_calls``, streamed as
    ``delta.tool_calls``; ``finish_reason`` ``tool_calls``). ``reasoning_parser`` (not
    "none"): a chat answer's ``<think>`` block goes to ``reasoning`` (and
    ``reasoning_content``, its older name in vLLM and DeepSeek's API), the tool calls and
    ``content`` coming from the rest. A grammar (a response format, a required or named
    tool) holds from the end of the reasoning, as in vLLM, where the answer starts inside
    it; an answer it constrains from the first token has no reasoning (the tokenizer then
    reports a closed block: ``common.reasoning``)."""

    def __init__(
        self,
        api: ApiRequest,
        response_id: str,
        created: int,
        tool_format: str = "hermes",
        reasoning_parser: str = "none",
    ) -> None:
        self.api = api
        self.chat = api.kind == "chat"
        self.reasoning_parser = reasoning_parser
        self.reasoning = reasoning_parser != "none" and self.chat
        self.head: Json = {
            "id": response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": created,
            "model": api.model,
        }
        self.choices = [Choice() for _ in range(api.num_choices)]
        if api.tools is not None and api.tools.mode != "none":
            names = {t["function"]["name"] for t in json.loads(api.tools.tools)}
            for choice in self.choices:
                choice.tools = ToolCallParser(tool_format, names)

    # --- streaming ---------------------------------------------------------------------------

    def opening_chunks(self) -> list[Json]:
        """Chat streams open each choice with the assistant role, as OpenAI does (with
        continuous usage: the prompt's, nothing generated yet; built after the stream's first
        delta, which carries the prompt's usage, went through ``add``)."""
        if not self.chat:
            return []
        return [
            self.chunk(i, {"delta": {"role": "assistant", "content": ""}}, opening=True)
            for i in range(self.api.num_choices)
        ]

    def add(self, index: int, delta: TextDelta) -> list[Json]:
        """Record ``delta`` for choice ``index``; return the chunks that stream it."""
        choice = self.choices[index]
        chunks = []
        if self.api.echo_only:
            delta = scored_only(delta)
        choice.tokens += len(delta.token_ids)
        if delta.usage is not None:
            choice.usage = delta.usage
        text = delta.text
        if delta.prompt_logprobs is not None:
            choice.prompt = delta.prompt_logprobs
        head = None  # the echoed prompt's logprobs, on its first chunk
        if self.api.echo and not choice.echoed:
            choice.echoed = True
            own = self.api.prompts[index // self.api.n]  # (a batch's: the choice's prompt)
            prompt = own.prompt if own.prompt is not None else delta.prompt_text
            text = (prompt or "") + text
            num_top = self.api.params.logprobs
            if num_top is not None and choice.prompt is not None:
                head = choice.echo_logprobs = echo_logprobs(choice.prompt, num_top)
                choice.token_chars = choice.echo_chars = sum(len(t) for t in head["tokens"])
        entries = delta.logprobs or []
        thought = ""
        if self.reasoning:
            thought, text, hidden = self.split_reasoning(choice, delta, text)
            if hidden and not text:
                entries = []  # (the logprobs of reasoning left out go with it)
        calls: list[CallDelta] = []
        if choice.tools is not None:
            text, calls = choice.tools.feed(text)
            if delta.finish_reason is not None:
                rest, more = choice.tools.finish()
                text, calls = text + rest, calls + more
        if thought and calls:  # the reasoning first, then the calls that follow it
            chunks.append(self.text_chunk(index, choice, "", thought, entries, head))
            thought, entries, head = "", [], None
        chunks += [self.call_chunk(index, call) for call in calls]
        if choice.tools is not None or self.reasoning:
            # Logprobs wait with the text a parser holds back (it may open a call, or be a
            # tag), and go out with the next text, or at the end: a chunk never has them alone.
            entries = choice.held_logprobs + entries
            choice.held_logprobs = []
            if not text and not thought and delta.finish_reason is None:
                choice.held_logprobs, entries = entries, []
        if text or thought or entries:
            chunks.append(self.text_chunk(index, choice, text, thought, entries, head))
        if delta.finish_reason is not None:
            reason = delta.finish_reason
            # "tool_calls" for calls the model chose (auto, required); a named tool_choice
            # ends with "stop", as OpenAI's and vLLM's do
            named = self.api.tools is not None and self.api.tools.mode == "function"
            if choice.tools is not None and choice.tools.calls and reason == "stop" and not named:
                reason = "tool_calls"
            choice.finish_reason = reason
            empty: Json = {"delta": {}} if self.chat else {"text": ""}
            chunks.append(self.chunk(index, {**empty, "finish_reason": reason}))
        return chunks

    def split_reasoning(self, choice: Choice, delta: TextDelta, text: str) -> tuple[str, str, bool]:
        """``text`` as (reasoning to show, content, whether reasoning was left out): a
        choice's splitter starts with its first delta (a resumed stream's first delta finds
        it there), where the prompt's last <think> tag says."""
        if choice.splitter is None:
            choice.splitter = ReasoningSplitter(
                starts_inside(self.reasoning_parser, delta.think), closed=delta.think == CLOSED
            )
        thought, text = choice.splitter.feed(text)
        if delta.finish_reason is not None:
            held_thought, held_text = choice.splitter.finish()
            thought, text = thought + held_thought, text + held_text
        if thought:
            choice.reasoning.append(thought)
        if self.api.include_reasoning:
            return thought, text, False
        return "", text, bool(thought)

    def text_chunk(
        self,
        index: int,
        choice: Choice,
        text: str,
        thought: str,
        entries: list[TextLogprob],
        head: Json | None,
    ) -> Json:
        """The chunk of a delta's text, reasoning and logprobs (``head``: the echoed
        prompt's), recorded for the whole response."""
        content: Json = {"delta": self.delta(text, thought)} if self.chat else {"text": text}
        if self.api.params.logprobs is not None:
            content["logprobs"] = joined(head, self.logprobs(entries, choice.token_chars))
        choice.text.append(text)
        choice.logprobs.extend(entries)
        choice.token_chars += sum(len(e.token) for e in entries)
        return self.chunk(index, content)

    @staticmethod
    def delta(text: str, thought: str) -> Json:
        """A chat chunk's delta: its content, its reasoning, or both (the delta that ends the
        reasoning), as vLLM's; a reasoning-only one has no content."""
        if not thought:
            return {"content": text}
        both = {"reasoning": thought, "reasoning_content": thought}
        return {**both, "content": text} if text else both

    def call_chunk(self, index: int, call: CallDelta) -> Json:
        """OpenAI's shape: a call opens with its index, id, type and name, then its arguments
        follow as fragments of their JSON text."""
        entry: Json = {"index": call.index, "function": {"arguments": call.arguments}}
        if call.id:
            entry.update(id=call.id, type="function")
            entry["function"]["name"] = call.name
        return self.chunk(index, {"delta": {"tool_calls": [entry]}})

    def chunk(self, index: int, fields: Json, opening: bool = False) -> Json:
        choice = {"index": index, "logprobs": None, "finish_reason": None, **fields}
        chunk = {**self.head, "choices": [choice]}
        if self.api.continuous_usage:  # vLLM's continuous_usage_stats: the usage so far
            chunk["usage"] = self.usage(generated=not opening)
        elif self.api.include_usage:
            chunk["usage"] = None  # OpenAI sends null usage on every chunk but the last
        return chunk

    def usage_chunk(self) -> Json:
        return {**self.head, "choices": [], "usage": self.usage()}

    # --- whole responses -----------------------------------------------------------------------

    def usage(self, generated: bool = True) -> Json:
        """Completion tokens summed over choices (so far, mid-stream); each prompt is counted
        once, its n choices sharing it (a batch's prompts are summed). ``generated=False``:
        the prompts' alone."""
        n = self.api.n
        prompt = cached = 0
        for k in range(len(self.api.prompts)):
            group = self.choices[k * n : (k + 1) * n]
            reported = [c.usage for c in group if c.usage is not None]
            prompt += reported[0].prompt_tokens if reported else 0
            cached += reported[0].cached_tokens if reported else 0
        completion = sum(c.completion_tokens for c in self.choices) if generated else 0
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
            if choice.splitter is not None:
                self.add_reasoning(body["message"], choice)
            if choice.tools is not None and choice.tools.calls:
                body["message"]["content"] = text or None
                body["message"]["tool_calls"] = [c.to_json() for c in choice.tools.calls]
            logprobs = None
            if self.api.params.logprobs is not None:
                logprobs = joined(
                    choice.echo_logprobs, self.logprobs(choice.logprobs, choice.echo_chars)
                )
            choices.append(
                {"index": i, **body, "logprobs": logprobs, "finish_reason": choice.finish_reason}
            )
            if not self.chat and choice.prompt is not None:
                choices[-1]["prompt_logprobs"] = prompt_logprobs_json(choice.prompt)
        kind = "chat.completion" if self.chat else "text_completion"
        out = {**self.head, "object": kind, "choices": choices, "usage": self.usage()}
        if self.chat and self.choices[0].prompt is not None:  # (vLLM's: one for the response)
            out["prompt_logprobs"] = prompt_logprobs_json(self.choices[0].prompt)
        return out

    def add_reasoning(self, message: Json, choice: Choice) -> None:
        """vLLM's: the reasoning (null where no block opened, or ``include_reasoning`` is
        false), and a content that is null where nothing follows it."""
        reasoned = choice.splitter is not None and choice.splitter.reasoned
        thought = "".join(choice.reasoning) if reasoned and self.api.include_reasoning else None
        message["reasoning"] = message["reasoning_content"] = thought
        if reasoned:
            message["content"] = message["content"] or None

    def logprobs(self, entries: list[TextLogprob], text_offset: int) -> Json:
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, text_offset)
