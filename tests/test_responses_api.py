"""OpenAI's Responses API through the whole mesh: the openai client's ``responses.create``,
streamed and not, held to the chat completion it is a view of (the same greedy or seeded
output), every response and event validated against the openai package's own pydantic
types; function tools (a call out, its output back in), structured output, and the 400s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from services.gateway.config import GatewayConfig
from services.gateway.responses_api import parse_responses
from services.gateway.responses_view import ResponsesView
from tests.mesh import MeshHarness, openai_client
from tests.models import QWEN_TOOLS, set_chat_template, write_tiny_model

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_tiny_model(
        tmp_path_factory.mktemp("responses") / "qwen2", "qwen2", max_position_embeddings=2048
    )
    return set_chat_template(folder, QWEN_TOOLS)


@pytest.fixture(scope="module")
def mesh(tools_model: Path):
    harness = MeshHarness(tools_model, kv_cache_tokens=8192).start()
    yield harness
    harness.stop()


@pytest.fixture
async def client(mesh: MeshHarness):
    async with openai_client(mesh.base_url) as c:
        yield c


async def post(mesh: MeshHarness, body: dict[str, Any]) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(mesh.base_url + "/responses", json=body) as response,
    ):
        return response.status, await response.json()


async def events_of(mesh: MeshHarness, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE stream's events, each checked: its ``event:`` line names its type."""
    events = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(mesh.base_url + "/responses", json={**body, "stream": True}) as response,
    ):
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        name = None
        async for raw in response.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                assert event["type"] == name
                events.append(event)
    return events


async def test_a_response_is_the_chat_completion_it_views(mesh, client) -> None:
    """instructions + an input of message items: the same text, usage and finish as chat
    with those turns; the body validates as openai's Response."""
    common = {"temperature": 0, "max_output_tokens": 12}
    out = await client.responses.create(
        model="tiny",
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
        extra_body={"ignore_eos": True},
        **common,
    )
    chat = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.output_text == chat.choices[0].message.content
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == 12 and out.usage.total_tokens == chat.usage.total_tokens
    assert out.id.startswith("resp_") and out.instructions == "Be brief."
    status, raw = await post(mesh, {"model": "tiny", "input": ASK, **common})
    assert status == 200
    Response.model_validate(raw)  # (every field openai's type requires, of its types)
    (item,) = raw["output"]
    assert item["type"] == "message" and item["content"][0]["type"] == "output_text"


async def test_the_stream_is_the_responses_events_in_order(mesh, client) -> None:
    """created, in_progress, the message item and its part opened, text deltas, then each
    closed and the response complete: numbered from 0, each a valid openai event, the deltas
    the whole response's text."""
    body = {"model": "tiny", "input": ASK, "max_output_tokens": 10}
    whole = await client.responses.create(**body, extra_body={"seed": 5})
    events = await events_of(mesh, {**body, "seed": 5})
    for event in events:
        EVENT.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    text = "".join(e["delta"] for e in deltas)
    assert (
        text == whole.output_text
        and events[-1]["response"]["output"][0]["content"][0]["text"] == text
    )
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []


async def test_a_function_call_out_and_its_output_back_in(mesh, client) -> None:
    """A required tool: a function_call item (streamed as argument deltas) with the chat
    call's name and arguments; the call and its output sent back as input items answer."""
    body = {"model": "tiny", "input": ASK, "tools": [WEATHER], "tool_choice": "required"}
    out = await client.responses.create(**body, max_output_tokens=80, extra_body={"seed": 2})
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    events = await events_of(mesh, {**body, "max_output_tokens": 80, "seed": 2})
    for event in events:
        EVENT.validate_python(event)
    fragments = [
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    ]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert "".join(fragments) == done[0]["arguments"] == calls[0].arguments
    follow = await client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": ASK},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=6,
    )
    assert follow.output[0].type == "message"


async def test_logprobs_of_the_answer(mesh, client) -> None:
    """include message.output_text.logprobs with top_logprobs (what the Agents SDK sends):
    each answer token's logprob and its top 2, the chat completion's; streamed on each text
    delta, the same in all."""
    body = {
        "model": "tiny",
        "input": ASK,
        "max_output_tokens": 6,
        "temperature": 0,
        "top_logprobs": 2,
        "include": ["message.output_text.logprobs"],
        "ignore_eos": True,
    }
    status, raw = await post(mesh, body)
    assert status == 200, raw
    Response.model_validate(raw)
    part = raw["output"][0]["content"][0]
    chat = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": ASK}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    want = [c.model_dump() for c in chat.choices[0].logprobs.content]
    assert part["logprobs"] == want and len(want) == 6
    assert all(len(entry["top_logprobs"]) == 2 for entry in part["logprobs"])
    events = await events_of(mesh, body)
    streamed = [
        lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]
    ]
    assert streamed == want and raw["top_logprobs"] == 2


async def test_structured_output_through_text_format(client) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    out = await client.responses.create(
        model="tiny",
        input=ASK,
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
        max_output_tokens=60,
    )
    assert set(json.loads(out.output_text)) == {"city"}
    assert out.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        ({"model": "tiny"}, "input", "Missing required"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
        ({"input": "x", "background": True}, "background", "not supported"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include[0]", "not supported"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
            "a string",
        ),
        ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens", "'max_output_tokens'"),
        (
            {
                "input": "x",
                "tools": [
                    {
                        "type": "function",
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "",
        ),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "between 1"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "function tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
            "Only text content",
        ),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role", "Unsupported role"),
        ({"input": [{"type": "computer_call"}]}, "input[0].type", "not supported"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type", ""),
    ],
)
async def test_bad_requests(mesh, body, param, text) -> None:
    status, answer = await post(mesh, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and text in answer["error"]["message"]


def test_reasoning_then_an_answer_are_two_items() -> None:
    """(Unit, from chat chunks as a reasoning parser gives them.) The reasoning item closes
    when the answer starts; each event validates."""
    echoed = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}
    view = ResponsesView("resp_x", 0, "m", echoed)
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"reasoning": "Think."}}]},
        {"choices": [{"index": 0, "delta": {"reasoning": " Done", "content": "Hi"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    events = view.opening() + view.add(chunks)
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    events += view.closing(usage)
    for event in events:
        EVENT.validate_python(event)
    reasoning, message = view.response()["output"]
    assert reasoning["content"][0]["text"] == "Think. Done"
    assert message["content"][0]["text"] == "Hi"
    assert events[-1]["type"] == "response.completed"
    Response.model_validate(view.response())


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def call(index: int, arguments: str, call_id: str = "", name: str = "") -> dict[str, Any]:
    entry: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id:
        entry |= {"id": call_id, "type": "function"}
        entry["function"]["name"] = name
    return {"tool_calls": [entry]}


ECHOED = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}


def test_text_before_a_call_in_one_delta_and_fragments_after_text() -> None:
    """(Unit.) The chat builder sends a delta's call before its text, even where the text
    came first: the message is still item 0 and the call item 1; the call stays open while
    text after it arrives, so its last fragment lands, and the events all validate."""
    view = ResponsesView("resp_x", 0, "m", ECHOED)
    deltas = [
        [chunk(call(0, '{"city": ', "call_1", "get_weather")), chunk({"content": "Sure."})],
        [chunk({"content": " Checking"}), chunk(call(0, '"Paris"}'))],
        [chunk(call(1, "{}", "call_2", "get_time")), chunk({}, "tool_calls")],
    ]
    events = view.opening()
    for chunks in deltas:
        events += view.add(chunks)
    usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    events += view.closing(usage)
    for event in events:
        EVENT.validate_python(event)
    out = view.response()["output"]
    assert [item["type"] for item in out] == [
        "message",
        "function_call",
        "message",
        "function_call",
    ]
    assert out[1]["arguments"] == '{"city": "Paris"}' and out[3]["name"] == "get_time"
    assert out[0]["content"][0]["text"] == "Sure." and out[2]["content"][0]["text"] == " Checking"
    assert all(item["status"] == "completed" for item in out)
    Response.model_validate(view.response())


def test_a_failure_mid_stream_ends_with_response_failed() -> None:
    view = ResponsesView("resp_x", 0, "m", ECHOED)
    events = view.opening() + view.add([chunk({"content": "Hel"})])
    events += view.failing("delivery_failed", "lost", None, 503)
    for event in events:
        EVENT.validate_python(event)
    assert [e["type"] for e in events[-5:]] == [
        "error",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert events[-5]["code"] == "delivery_failed"
    assert failed["output"][0]["status"] == "incomplete"


def test_a_replayed_output_is_one_assistant_turn() -> None:
    """A response's output sent back (its message, then its calls) and the calls' outputs:
    one assistant turn holding the text and both calls, then the tool turns."""
    body = {
        "input": [
            {"role": "user", "content": ASK},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1",
             "output": [{"type": "input_text", "text": "21 C"}]},
            {"type": "reasoning", "summary": []},
        ],
        "include": ["reasoning.encrypted_content"],
        "tools": [WEATHER],
    }  # fmt: skip
    ask = parse_responses(body, GatewayConfig(served_model_name="tiny"))
    messages = ask.api.messages
    assert messages is not None
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[1].content == "Checking." and len(json.loads(messages[1].tool_calls)) == 2
    assert messages[2].content == "21 C" and messages[2].tool_call_id == "c1"
