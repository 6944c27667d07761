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
``include`` but the answer's logprobs (and ``reasoning.encrypted_content``, which changes
nothing: no reasoning is encrypted), and input other than text (images, files).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.runtime import RequestError
from services.gateway.body import Body, bad_request, wrong_type
from services.gateway.config import GatewayConfig
from services.gateway.protocol import ApiRequest, parse_chat
from services.gateway.responses import Json

# Fields copied to the chat body as they are (the rest are translated or refused)
SHARED = (
    "model", "stream", "temperature", "top_p", "parallel_tool_calls", "user",
    "priority", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "ignore_eos", "min_tokens",
)  # fmt: skip
# Chat's field names in a parser's 400 -> the Responses body's
RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
    "tool_choice.function": "tool_choice",
}
# include values that change nothing here (no reasoning is encrypted: none is stored), and
# the one that asks for the answer's logprobs
IGNORED_INCLUDES = frozenset({"reasoning.encrypted_content"})
LOGPROBS = "message.output_text.logprobs"


@dataclass(frozen=True)
class ResponsesRequest:
    api: ApiRequest  # the chat request it means
    echoed: Json  # the settings the response repeats
    origins: list[str]  # each chat message's field in the Responses body

    def renamed(self, exc: RequestError) -> RequestError:
        return renamed(exc, self.origins)


def parse_responses(raw: Any, config: GatewayConfig) -> ResponsesRequest:
    """The chat request the body means, and the request's settings the response echoes."""
    body = Body(raw)
    refuse_unsupported(body)
    chat: Json = {k: raw[k] for k in SHARED if raw.get(k) is not None}
    origins: list[str] = []  # each chat message's field in the Responses body
    messages: list[Json] = []
    instructions = body.string("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    for message, origin in input_messages(body.get("input")):
        last = messages[-1] if messages else {}
        if message.get("tool_calls") and last.get("role") == "assistant":
            # one turn: what the model wrote, then its calls (as a response's output replays)
            last["tool_calls"] = last.get("tool_calls", []) + message["tool_calls"]
            continue
        messages.append(message)
        origins.append(origin)
    chat["messages"] = messages
    if raw.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = raw["max_output_tokens"]
    top = raw.get("top_logprobs")
    if LOGPROBS in (raw.get("include") or []) or top:  # (the Agents SDK sends both)
        chat["logprobs"] = True
        chat["top_logprobs"] = top if top is not None else 0
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
        "parallel_tool_calls": body.boolean("parallel_tool_calls", True),
        "text": {"format": (text or {}).get("format") or {"type": "text"}},
        "metadata": raw.get("metadata") or {},
        "user": raw.get("user"),
        "truncation": "auto" if raw.get("truncation") == "auto" else "disabled",
        "top_logprobs": api.params.logprobs,
    }
    return ResponsesRequest(api, echoed, origins)


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
    include = body.get("include") or []
    if not isinstance(include, list):
        raise wrong_type("include", "an array of strings", include)
    for i, value in enumerate(include):
        if value not in IGNORED_INCLUDES and value != LOGPROBS:
            raise bad_request(
                f"'include' of {value!r} is not supported.",
                f"include[{i}]",
                "unsupported_parameter",
            )
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
            fields = [item.get(k) for k in ("call_id", "name", "arguments")]
            for key, value in zip(("call_id", "name", "arguments"), fields, strict=True):
                if not isinstance(value, str):
                    raise wrong_type(f"{where}.{key}", "a string", value)
            call_id, name, arguments = fields
            call = {"id": call_id, "type": "function"}
            call["function"] = {"name": name, "arguments": arguments}
            out.append(({"role": "assistant", "content": "", "tool_calls": [call]}, where))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise wrong_type(f"{where}.call_id", "a string", call_id)
            if isinstance(output, list):  # (input_text parts)
                output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
            if not isinstance(output, str):
                raise wrong_type(f"{where}.output", "a string or text parts", output)
            out.append(({"role": "tool", "tool_call_id": call_id, "content": output}, where))
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
    elif param.startswith("tools[") and ".function." in param:
        param = param.replace(".function.", ".", 1)  # (Responses' tools are flat)
    else:
        for chat, ours in RENAMED.items():  # (longest first: the dict lists them so)
            if param == chat or param.startswith(chat + "."):
                param = ours + param[len(chat) :]
                break
    message = str(exc)
    if exc.param and param != exc.param:  # (the message names the field too)
        message = message.replace(f"'{exc.param}'", f"'{param}'")
    return RequestError(message, exc.status, exc.type, param or None, exc.code)
