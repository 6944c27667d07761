"""Validation of the structured-output fields of a chat request: ``response_format``,
``tools``/``tool_choice`` and an assistant turn's ``tool_calls``, as OpenAI defines them.

Only the shape is checked here; whether xgrammar can enforce a schema is decided by the
tokenizer, which converts it (a 400 naming the part it cannot enforce).
"""

from __future__ import annotations

import json
from typing import Any

from common.runtime import RequestError
from common.wire.tokenizer import ResponseFormat, ToolChoice
from services.gateway.body import Body, bad_request, check_unicode, unicode_text, wrong_type

# A function name as OpenAI allows it.
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_TOOLS = 128


def unsupported(name: str) -> RequestError:
    return bad_request(f"'{name}' is not supported.", name, "unsupported_parameter")


def parse_response_format(body: Body) -> ResponseFormat | None:
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise wrong_type("response_format", "an object", value)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise bad_request(
            "'response_format.type' must be one of 'text', 'json_object', 'json_schema', "
            f"got {kind!r}.",
            "response_format.type",
            "invalid_value",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise wrong_type("response_format.json_schema", "an object", spec)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(
            "Missing required parameter: 'response_format.json_schema.name'.",
            "response_format.json_schema.name",
            "missing_required",
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise wrong_type("response_format.json_schema.schema", "an object", schema)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise wrong_type("response_format.json_schema.strict", "a boolean", strict)
    name = unicode_text(name, "response_format.json_schema.name")
    return ResponseFormat("json_schema", json.dumps(schema), name)


# vLLM's structured-output fields (older guided_* and newer structured_outputs.*) -> kind
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # fmt: skip
STRUCTURED_OUTPUT_KINDS = tuple(GUIDED.values())


def parse_structured_output(body: Body) -> ResponseFormat | None:
    """``response_format``, or vLLM's ``guided_json``/``guided_regex``/``guided_choice``/
    ``guided_grammar`` or ``structured_outputs`` (one of json, regex, choice, grammar): at
    most one of them; each is enforced (a request that names one is never served unconstrained).
    """
    found: list[tuple[str, str, Any]] = []  # (param, kind, value)
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, kind, body.get(name)))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise wrong_type("structured_outputs", "an object", outputs)
        for kind in STRUCTURED_OUTPUT_KINDS:
            if outputs.get(kind) is not None:
                found.append((f"structured_outputs.{kind}", kind, outputs[kind]))
    response_format = parse_response_format(body)
    if response_format is not None:
        found.append(("response_format", "", response_format))
    if len(found) > 1:
        raise bad_request(
            "Give one output constraint: " + ", ".join(f"'{p}'" for p, _, _ in found) + ".",
            found[1][0],
            "invalid_value",
        )
    if not found:
        return None
    param, kind, value = found[0]
    if isinstance(value, ResponseFormat):
        return value
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"'{param}' is not valid JSON.", param) from None
        if not isinstance(value, dict):
            raise wrong_type(param, "a JSON schema (an object)", value)
        return ResponseFormat("json_schema", json.dumps(value), param, param)
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise wrong_type(param, "a non-empty list of non-empty strings", value)
        choices = [unicode_text(c, f"{param}[{i}]") for i, c in enumerate(value)]
        return ResponseFormat("choice", json.dumps(choices), param, param)
    if not isinstance(value, str) or not value:
        raise wrong_type(param, "a non-empty string", value)
    return ResponseFormat(kind, unicode_text(value, param), param, param)


def parse_tools(body: Body) -> ToolChoice | None:
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise bad_request(
            "'functions' and 'function_call' are deprecated and not supported: use 'tools' "
            "and 'tool_choice'.",
            "functions",
            "unsupported_parameter",
        )
    parallel = body.boolean("parallel_tool_calls", True)
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad_request(
                "'tool_choice' needs 'tools' to choose from.", "tool_choice", "invalid_value"
            )
        return None
    if not isinstance(tools, list):
        raise wrong_type("tools", "an array", tools)
    if len(tools) > MAX_TOOLS:
        raise bad_request(
            f"'tools' may hold at most {MAX_TOOLS} tools, got {len(tools)}.",
            "tools",
            "invalid_value",
        )
    functions = [parse_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    names = [f["function"]["name"] for f in functions]
    mode, name = parse_tool_choice(choice, names)
    return ToolChoice(json.dumps(functions), mode, name, parallel)


def parse_tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise wrong_type(where, "an object", tool)
    if tool.get("type", "function") != "function":
        raise bad_request(
            f"Only function tools are supported, got type {tool.get('type')!r}.",
            f"{where}.type",
            "unsupported_value",
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise wrong_type(f"{where}.function", "an object", function)
    name = function.get("name")
    if not isinstance(name, str) or not name or not set(name) <= NAME_CHARS or len(name) > 64:
        raise bad_request(
            f"'{where}.function.name' must be 1-64 characters of a-z, A-Z, 0-9, _ and -, "
            f"got {name!r}.",
            f"{where}.function.name",
            "invalid_value",
        )
    out: dict[str, Any] = {"name": name}
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise wrong_type(f"{where}.function.description", "a string", description)
        out["description"] = description
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise wrong_type(f"{where}.function.parameters", "an object", parameters)
        out["parameters"] = parameters
    return {"type": "function", "function": out}


def parse_tool_choice(choice: Any, names: list[str]) -> tuple[str, str]:
    if choice is None:
        return "auto", ""
    if choice in ("none", "auto", "required"):
        return str(choice), ""
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise wrong_type("tool_choice.function.name", "a string", name)
        if name not in names:
            raise bad_request(
                f"'tool_choice' names the function {name!r}, which is not in 'tools'.",
                "tool_choice.function.name",
                "invalid_value",
            )
        return "function", name
    raise bad_request(
        "'tool_choice' must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}.',
        "tool_choice",
        "invalid_value",
    )


def parse_message_tool_calls(value: Any, where: str) -> str:
    """An assistant turn's ``tool_calls`` as JSON text for the chat template, arguments
    decoded into objects (templates render ``arguments | tojson``)."""
    if not isinstance(value, list):
        raise wrong_type(where, "an array", value)
    calls = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(call, dict):
            raise wrong_type(at, "an object", call)
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise wrong_type(f"{at}.function", "an object with a name", function)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
                raise bad_request(
                    f"'{at}.function.arguments' is not valid JSON.",
                    f"{at}.function.arguments",
                    "invalid_value",
                ) from None
            check_unicode(arguments, f"{at}.function.arguments")  # (escaped twice over)
        calls.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    try:
        return json.dumps(calls)
    except RecursionError:  # arguments nested just under the decoder's limit, plus 3 levels
        raise bad_request(
            f"'{where}' holds arguments nested too deeply.", where, "invalid_value"
        ) from None
