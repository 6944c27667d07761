"""OpenAI's Responses API (``POST /v1/responses``), as a view of a chat completion.

A Responses body is translated into the chat-completions body it means (``instructions`` a
system turn, ``input`` items turns: messages, ``function_call`` items an assistant turn's
calls, ``function_call_output`` items tool turns; flat function tools nested as chat's;
``text.format`` a response format; ``max_output_tokens``) and validated by the chat parser,
so everything chat does holds (templates, tool-call parsing and grammars, structured
outputs, reasoning parsers, sampling, priorities, LoRA adapters). The chat stream's chunks
are then translated into the Responses shape: output items (a ``reasoning`` item, the
``message`` with its ``output_text``, one ``function_call`` per call), streamed as
Responses events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``, each numbered), or returned whole.

Not offered (a 400 says so): stored responses (``previous_response_id``, ``background``;
nothing is stored, ``store`` is reported false), built-in tools (web or file search, ...),
``include``, and input other than text (images, files).
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from common.runtime import RequestError
from services.gateway.body import Body, bad_request, wrong_type
from services.gateway.config import GatewayConfig
from services.gateway.protocol import ApiRequest, parse_chat
from services.gateway.responses import Json

# Fields copied to the chat body as they are (the rest are translated or refused)
SHARED = (
    "model", "stream", "temperature", "top_p", "tools", "parallel_tool_calls", "user",
    "priority", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "ignore_eos", "min_tokens",
)  # fmt: skip
# Chat's field names in a parser's 400 -> the Responses body's
RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def parse_responses(raw: Any, config: GatewayConfig) -> tuple[ApiRequest, Json]:
    """The chat request the body means, and the request's settings the response echoes."""
    body = Body(raw)
    refuse_unsupported(body)
    chat: Json = {k: raw[k] for k in SHARED if raw.get(k) is not None and k != "tools"}
    origins: list[str] = []  # each chat message's field in the Responses body
    messages: list[Json] = []
    instructions = body.string("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    for message, origin in input_messages(body.get("input")):
        if message.get("tool_calls") and messages and messages[-1].get("tool_calls"):
            messages[-1]["tool_calls"] += message["tool_calls"]  # (one turn, several calls)
            continue
        messages.append(message)
        origins.append(origin)
    chat["messages"] = messages
    if raw.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = raw["max_output_tokens"]
    if raw.get("tools") is not None:
        chat["tools"] = chat_tools(raw["tools"])
    if raw.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(raw["tool_choice"])
    text = raw.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise wrong_type("text", "an object", text)
        if text.get("format") is not None:
            chat["response_format"] = response_format(text["format"])
    try:
        api = parse_chat(chat, config)
    except RequestError as exc:
        raise renamed(exc, origins) from None
    echoed = {
        "instructions": instructions,
        "max_output_tokens": raw.get("max_output_tokens"),
        "temperature": api.params.temperature,
        "top_p": api.params.top_p,
        "tools": raw.get("tools") or [],
        "tool_choice": raw.get("tool_choice") or "auto",
        "parallel_tool_calls": raw.get("parallel_tool_calls", True),
        "text": {"format": (text or {}).get("format") or {"type": "text"}},
        "metadata": raw.get("metadata") or {},
        "user": raw.get("user"),
    }
    return api, echoed


def refuse_unsupported(body: Body) -> None:
    for name, why in (
        ("previous_response_id", "responses are not stored: send the whole conversation"),
        ("conversation", "conversations are not stored: send the whole conversation"),
        ("prompt", "prompt templates are not supported"),
    ):
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is not supported: {why}.", name, "unsupported_parameter")
    if body.boolean("background", False):
        raise bad_request(
            "'background' is not supported: responses are not stored.",
            "background",
            "unsupported_parameter",
        )
    include = body.get("include")
    if include:
        raise bad_request("'include' is not supported.", "include", "unsupported_parameter")
    if body.get("input") is None:
        raise bad_request("Missing required parameter: 'input'.", "input", "missing_required")


def input_messages(value: Any) -> list[tuple[Json, str]]:
    """The ``input`` as chat messages, each with its item's field."""
    if isinstance(value, str):
        return [({"role": "user", "content": value}, "input")]
    if not isinstance(value, list) or not value:
        raise wrong_type("input", "a string or a non-empty array of input items", value)
    out = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(where, "an object", item)
        kind = item.get("type", "message")
        if kind == "message":
            out.append((message(item, where), where))
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            out.append(({"role": "assistant", "content": "", "tool_calls": [call]}, where))
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise wrong_type(f"{where}.output", "a string", output)
            turn = {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
            out.append((turn, where))
        elif kind != "reasoning":  # (earlier reasoning is not sent back to the model)
            raise bad_request(
                f"Input items of type {kind!r} are not supported (message, function_call, "
                "function_call_output, reasoning).",
                f"{where}.type",
                "unsupported_value",
            )
    if not out:
        raise bad_request("'input' holds no message.", "input", "invalid_value")
    return out


def message(item: Json, where: str) -> Json:
    content = item.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise bad_request(
                    f"Only text content is supported (input_text, output_text), got {kind!r}.",
                    f"{where}.content[{j}].type",
                    "unsupported_value",
                )
            parts.append({"type": "text", "text": part.get("text")})
        content = parts
    return {"role": item.get("role"), "content": content}


def chat_tools(tools: Any) -> Any:
    """Responses' flat function tools as chat's nested ones."""
    if not isinstance(tools, list):
        raise wrong_type("tools", "an array", tools)
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise bad_request(
                f"Only function tools are supported, got {kind!r}.",
                f"tools[{i}].type",
                "unsupported_value",
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict):
        raise bad_request(
            f"tool_choice of type {choice.get('type')!r} is not supported.",
            "tool_choice",
            "unsupported_value",
        )
    return choice


def response_format(fmt: Any) -> Any:
    if not isinstance(fmt, dict):
        raise wrong_type("text.format", "an object", fmt)
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def renamed(exc: RequestError, origins: list[str]) -> RequestError:
    """A chat parser's 400, naming the Responses body's field."""
    param = exc.param or ""
    if param.startswith("messages["):
        index, _, rest = param[len("messages[") :].partition("]")
        if index.isdigit() and int(index) < len(origins):
            param = origins[int(index)] + rest
    elif param == "messages":
        param = "input"
    else:
        head, dot, rest = param.partition(".")
        param = RENAMED.get(head, head) + dot + rest if head else param
    return RequestError(str(exc), exc.status, exc.type, param or None, exc.code)


class ResponsesView:
    """The chat stream's chunks as Responses output items and events (``events``), and the
    whole response (``response``)."""

    def __init__(self, response_id: str, created: int, model: str, echoed: Json) -> None:
        self.id, self.created, self.model, self.echoed = response_id, created, model, echoed
        self.items: list[Json] = []
        self.open: Json | None = None  # the item being streamed
        self.sequence = 0
        self.status = "in_progress"
        self.incomplete: Json | None = None
        self.usage: Json | None = None

    # --- events ---------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> Json:
        """One event, a snapshot: the items it shows go on changing until it is sent."""
        event = {"type": kind, "sequence_number": self.sequence, **copy.deepcopy(fields)}
        self.sequence += 1
        return event

    def opening(self) -> list[Json]:
        snapshot = self.response()
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def add(self, chunks: list[Json]) -> list[Json]:
        """The events of a chat stream's chunks (the role's opening chunk brings none)."""
        events: list[Json] = []
        for chunk in chunks:
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                if delta.get("reasoning"):
                    events += self.text("reasoning", delta["reasoning"])
                for call in delta.get("tool_calls") or []:
                    events += self.call(call)
                if delta.get("content"):
                    events += self.text("message", delta["content"])
                if choice.get("finish_reason") is not None:
                    events += self.close()
                    self.finish(choice["finish_reason"])
        return events

    def text(self, kind: str, delta: str) -> list[Json]:
        """Reasoning or answer text, into the open item of its kind (opened if need be)."""
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else OUTPUT_TEXT
            item: Json = (
                {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
                if kind == "reasoning"
                else {"id": new_id("msg"), "type": "message", "role": "assistant", "content": []}
            )
            item["status"] = "in_progress"
            self.open = item
            events.append(self.event("response.output_item.added", **self.where(), item=item))
            item["content"].append(copy.deepcopy(part))
            events.append(
                self.event(
                    "response.content_part.added", **self.where(), content_index=0, part=part
                )
            )
        assert self.open is not None
        self.open["content"][0]["text"] += delta
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra: Json = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, **self.where(), content_index=0, delta=delta, **extra))
        return events

    def call(self, call: Json) -> list[Json]:
        """A tool call's fragment: its first opens a ``function_call`` item."""
        events = []
        function = call.get("function") or {}
        if call.get("id"):
            events += self.close()
            self.open = {
                "id": new_id("fc"),
                "type": "function_call",
                "call_id": call["id"],
                "name": function.get("name", ""),
                "arguments": "",
                "status": "in_progress",
            }
            events.append(self.event("response.output_item.added", **self.where(), item=self.open))
        assert self.open is not None and self.open["type"] == "function_call"
        fragment = function.get("arguments") or ""
        if fragment:
            self.open["arguments"] += fragment
            events.append(
                self.event("response.function_call_arguments.delta", **self.where(), delta=fragment)
            )
        return events

    def close(self) -> list[Json]:
        """The open item's closing events; it joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        item["status"] = "completed"
        events = []
        if item["type"] == "function_call":
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            done = (
                "response.reasoning_text.done"
                if item["type"] == "reasoning"
                else ("response.output_text.done")
            )
            extra: Json = {} if item["type"] == "reasoning" else {"logprobs": []}
            events.append(self.event(done, **where, content_index=0, text=part["text"], **extra))
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        events.append(
            self.event("response.output_item.done", output_index=where["output_index"], item=item)
        )
        return events

    def where(self) -> Json:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def finish(self, reason: str) -> None:
        if reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"

    def closing(self, usage: Json) -> list[Json]:
        self.usage = responses_usage(usage)
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return [*self.close(), self.event(kind, response=self.response())]

    # --- the whole response ---------------------------------------------------------------

    def response(self) -> Json:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": self.status,
            "background": False,
            "error": None,
            "incomplete_details": self.incomplete,
            "model": self.model,
            "output": self.items,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "truncation": "disabled",
            "usage": self.usage,
            **self.echoed,
        }


OUTPUT_TEXT: Json = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


def responses_usage(usage: Json) -> Json:
    """Chat's usage in the Responses names."""
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
