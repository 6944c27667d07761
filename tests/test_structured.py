"""Structured outputs and tool calling through the whole mesh, with the official openai client:
``response_format`` (json_schema, json_object, pydantic via ``parse``), ``tools`` with
``tool_choice`` required and named (streamed and not), a conversation with a tool result,
``logit_bias``, and a schema the grammar engine cannot enforce.

The tiny model is random, so its text is noise: the grammar alone makes it valid. The schemas
are bounded (enums, booleans, bounded arrays), so every document ends well within
``max_tokens`` and the tests can require ``finish_reason == "stop"`` and a valid document.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
import xgrammar as xgr

from common.tokenizer import Tokenizer
from common.wire.tokenizer import ResponseFormat
from services.tokenizer.grammars import grammar_for
from tests.mesh import MeshHarness, openai_client
from tests.models import QWEN_TOOLS, set_chat_template, write_tiny_model

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "role": {"enum": ["admin", "guest"]},
                    "active": {"type": "boolean"},
                },
                "required": ["role", "active"],
            },
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["user", "level"],
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "done": {"type": "boolean"},
        },
        "required": ["tags", "done"],
    },
    "enums_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"kind": {"enum": ["a", "b"]}, "flag": {"type": "null"}},
                    "required": ["kind", "flag"],
                },
                "maxItems": 2,
            }
        },
        "required": ["items"],
    },
}

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Tokyo"]},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    """A tiny Qwen2 with Qwen2.5's tool-aware chat template (room for the tools prompt)."""
    folder = write_tiny_model(
        tmp_path_factory.mktemp("tools") / "qwen2", "qwen2", max_position_embeddings=2048
    )
    return set_chat_template(folder, QWEN_TOOLS)


@pytest.fixture(scope="module")
def mesh(tools_model):
    harness = MeshHarness(tools_model, kv_cache_tokens=8192).start()
    yield harness
    harness.stop()


@pytest.fixture
async def client(mesh):
    async with openai_client(mesh.base_url) as c:
        yield c


def schema_format(name: str) -> Any:
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
    }


async def stream_choices(client, **kwargs) -> tuple[dict[int, str], dict[int, str], dict[int, Any]]:
    """Text, finish reason and tool calls per choice index, from a streamed chat."""
    text: dict[int, str] = {}
    reasons: dict[int, str] = {}
    calls: dict[int, dict[int, dict[str, Any]]] = {}
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text[choice.index] = text.get(choice.index, "") + (choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(choice.index, {}).setdefault(
                    call.index, {"id": "", "name": "", "arguments": "", "fragments": 0}
                )
                slot["id"] += call.id or ""
                if call.function is not None:
                    slot["name"] += call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""
                    slot["fragments"] += bool(call.function.arguments)
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return text, reasons, calls


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("stream", [False, True])
async def test_json_schema_outputs_validate(client, name, stream):
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": f"Give me a {name} record."}],
        response_format=schema_format(name),
        max_tokens=200,
        n=2,
        seed=11,
        temperature=1.0,
    )
    if stream:
        text, reasons, _ = await stream_choices(client, **kwargs)
    else:
        reply = await client.chat.completions.create(**kwargs)
        text = {c.index: c.message.content for c in reply.choices}
        reasons = {c.index: c.finish_reason for c in reply.choices}
    assert sorted(text) == [0, 1]
    for i in (0, 1):
        assert reasons[i] == "stop", (reasons, text)
        jsonschema.validate(json.loads(text[i]), SCHEMAS[name])


async def test_a_cut_document_ends_with_length(client):
    reply = await client.chat.completions.create(
        model="tiny",
        messages=ASK,
        response_format=schema_format("nested"),
        max_tokens=3,
    )
    assert reply.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(reply.choices[0].message.content)


async def test_json_object_is_an_object_or_cut_by_length(client):
    reply = await client.chat.completions.create(
        model="tiny",
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=120,
        n=3,
        seed=5,
    )
    for choice in reply.choices:
        text = choice.message.content
        assert text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # free keys and strings: a random model may not close the object in time
            assert choice.finish_reason == "length"


async def test_vllms_guided_fields_are_enforced_on_both_endpoints(client):
    """guided_json/regex/choice/grammar and structured_outputs (vLLM's), and response_format on
    /v1/completions, were ignored: a 200 with free text where the client expected the
    constraint."""
    choices = ["sunny", "rain, then sun", "snow"]
    reply = await client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=20, n=3, seed=1,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert all(c.message.content in choices for c in reply.choices)
    out = await client.completions.create(
        model="tiny", prompt="Code:", max_tokens=20, seed=2,
        extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}},
    )  # fmt: skip
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", out.choices[0].text), out.choices[0].text
    out = await client.completions.create(
        model="tiny", prompt="Answer:", max_tokens=10, seed=3,
        extra_body={"guided_grammar": 'root ::= ("yes" | "no") "!"'},
    )  # fmt: skip
    assert out.choices[0].text in ("yes!", "no!")
    out = await client.completions.create(
        model="tiny", prompt="JSON:", max_tokens=100, seed=4,
        extra_body={"guided_json": SCHEMAS["array"]},
    )  # fmt: skip
    if out.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(out.choices[0].text), SCHEMAS["array"])
    else:
        assert out.choices[0].text.startswith("{")
    out = await client.completions.create(
        model="tiny", prompt="JSON:", max_tokens=100, seed=5,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert out.choices[0].text.startswith("{")
    for body, param, code in (
        ({"guided_regex": "([a-"}, "guided_regex", "invalid_regex"),
        ({"guided_choice": []}, "guided_choice", None),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "invalid_value"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="tiny", prompt="x", extra_body=body)
        error: Any = info.value.body
        assert error["param"] == param and (code is None or error["code"] == code), error


class Forecast(pydantic.BaseModel):
    city: Literal["Paris", "Tokyo"]
    rain: bool
    level: Literal[1, 2, 3]


async def test_parse_with_a_pydantic_model(client):
    # openai 1.x/3.x: chat.completions.parse (beta.chat.completions.parse is its older alias)
    reply = await client.chat.completions.parse(
        model="tiny", messages=ASK, response_format=Forecast, max_tokens=100
    )
    message = reply.choices[0].message
    assert isinstance(message.parsed, Forecast)
    assert Forecast.model_validate_json(message.content) == message.parsed


def check_call(name: str, arguments: str, call_id: str, only: str | None = None) -> None:
    assert name in PARAMS and (only is None or name == only)
    jsonschema.validate(json.loads(arguments), PARAMS[name])
    assert call_id.startswith("call_")


@pytest.mark.parametrize("choice", ["required", "named"])
async def test_forced_tool_calls(client, choice):
    tool_choice: Any = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_time"}}
    )
    only = None if choice == "required" else "get_time"
    kwargs = dict(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, seed=3
    )
    reply = await client.chat.completions.create(**kwargs)
    out = reply.choices[0]
    # A named choice ends with "stop", as OpenAI's and vLLM's do; the model's choice of calls
    # (auto, required) with "tool_calls"
    reason = "tool_calls" if choice == "required" else "stop"
    assert out.finish_reason == reason
    assert out.message.content is None and len(out.message.tool_calls) == 1
    call = out.message.tool_calls[0]
    assert call.type == "function"
    check_call(call.function.name, call.function.arguments, call.id, only)

    text, reasons, calls = await stream_choices(client, **kwargs)
    assert reasons == {0: reason} and text == {0: ""}
    (streamed,) = calls[0].values()
    check_call(streamed["name"], streamed["arguments"], streamed["id"], only)
    assert streamed["fragments"] > 1  # the arguments stream as they are generated
    # Same seed, same tokens: the streamed call is the one the full response parsed.
    assert (streamed["name"], json.loads(streamed["arguments"])) == (
        call.function.name,
        json.loads(call.function.arguments),
    )


async def test_a_required_tool_choice_makes_parallel_calls_unless_turned_off(client, tools_model):
    """``required`` was held to one call in hermes (and llama3_json). With the stop tokens
    biased away, the grammar leaves the model a second call to write after its first;
    ``parallel_tool_calls: false`` allows nothing after one call but a stop token."""
    stops = {str(t): -100 for t in Tokenizer.from_folder(tools_model).eos_token_ids}
    kwargs: dict[str, Any] = dict(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", seed=3
    )
    one = await client.chat.completions.create(parallel_tool_calls=False, max_tokens=120, **kwargs)
    assert one.choices[0].finish_reason == "tool_calls"
    assert len(one.choices[0].message.tool_calls) == 1
    cut = one.usage.completion_tokens * 2 + 10  # past two calls of that length: cut in a third
    more = await client.chat.completions.create(max_tokens=cut, logit_bias=stops, **kwargs)
    out = more.choices[0]
    assert out.finish_reason == "length"
    whole = [c for c in out.message.tool_calls or [] if c.function.arguments.endswith("}")]
    assert len(whole) >= 2, out.message
    for call in whole:
        check_call(call.function.name, call.function.arguments, call.id, None)
    held = await client.chat.completions.create(
        parallel_tool_calls=False, max_tokens=cut, logit_bias=stops, **kwargs
    )
    # one call, then nothing but a stop token: biased away but still the only one allowed
    assert held.choices[0].finish_reason == "tool_calls"
    assert held.usage.completion_tokens == one.usage.completion_tokens


async def test_a_conversation_with_a_tool_result(client, tools_model):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    reply = await client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=160,
    )
    out = reply.choices[0]
    assert out.finish_reason == "stop", out.message.content  # (a named tool_choice)
    check_call(
        out.message.tool_calls[0].function.name,
        out.message.tool_calls[0].function.arguments,
        out.message.tool_calls[0].id,
        "get_time",
    )
    # The tool turn reached the model through the template, as transformers renders it.
    tok = Tokenizer.from_folder(tools_model)
    rendered = [
        ASK[0],
        {
            **messages[1],
            "content": "",
            "tool_calls": [
                {
                    **call,
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Paris", "unit": "celsius"},
                    },
                }
            ],
        },
        messages[2],
    ]
    prompt = tok.apply_chat_template(rendered, tools=TOOLS)
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt
    assert reply.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))


async def test_tool_choice_none_and_auto_answer_in_text(client):
    for mode in ("none", "auto"):
        reply = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice=mode, max_tokens=8, seed=1
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert not reply.choices[0].message.tool_calls


async def test_logit_bias_forces_and_bans(client, tools_model):
    tok = Tokenizer.from_folder(tools_model)
    forced = tok.encode("fox")[0]
    reply = await client.completions.create(
        model="tiny", prompt="The", max_tokens=5, logit_bias={str(forced): 100}, seed=2
    )
    assert reply.choices[0].text == tok.decode([forced] * 5)
    allowed = tok.encode("ab")[:2]
    banned = {str(t): -100 for t in range(512) if t not in allowed}
    reply = await client.completions.create(
        model="tiny", prompt="The", max_tokens=10, logit_bias=banned, seed=2
    )
    assert reply.choices[0].finish_reason == "length"
    assert set(tok.encode(reply.choices[0].text)) <= set(allowed)


async def test_a_schema_xgrammar_cannot_enforce_is_a_400_naming_the_part(client):
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "code": {"type": "string", "pattern": "(?<=a)b"},
        },
    }
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    error: Any = info.value.body
    assert error["param"] == "response_format.json_schema.schema"
    assert error["code"] == "invalid_schema"
    assert "/properties/code" in error["message"] and "Lookbehind" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(
            model="tiny", prompt="x", max_tokens=2, logit_bias={"100000": 5}
        )
    body: Any = info.value.body
    assert "logit_bias" in body["message"]
    # The mesh keeps serving.
    reply = await client.chat.completions.create(
        model="tiny", messages=ASK, response_format=schema_format("array"), max_tokens=100
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMAS["array"])


async def test_speculative_decoding_keeps_outputs_valid(tools_model):
    harness = MeshHarness(
        tools_model, kv_cache_tokens=8192, speculator="ngram", num_speculative_tokens=3
    ).start()
    try:
        async with openai_client(harness.base_url) as c:
            for name in sorted(SCHEMAS):
                reply = await c.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "List list list list"}],
                    response_format=schema_format(name),
                    max_tokens=200,
                    n=2,
                    seed=4,
                )
                for choice in reply.choices:
                    assert choice.finish_reason == "stop"
                    jsonschema.validate(json.loads(choice.message.content or ""), SCHEMAS[name])
        spec = harness.executor_services[0].engine.spec
        assert spec.num_draft_tokens > 0  # drafts were proposed and checked
    finally:
        harness.stop()


@pytest.mark.parametrize("bound", [{"maxLength": 8}, {"minLength": 2}])
def test_a_string_of_bounded_length_takes_no_raw_control_character(bound):
    """xgrammar's bounded strings admitted a raw ESC, which JSON forbids (json.loads refused
    the document a random model wrote); the grammar now refuses it."""
    from xgrammar.testing import _is_grammar_accept_string

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", **bound}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fmt = ResponseFormat("json_schema", json.dumps(schema))
    wire = grammar_for(fmt, None, "hermes")
    assert wire is not None
    grammar = xgr.Grammar.from_ebnf(wire.ebnf)
    assert _is_grammar_accept_string(grammar, '{"city": "Paris"}')
    assert not _is_grammar_accept_string(grammar, '{"city": "a\x1bb"}')
