"""The gateway against a real nats-server and a fake mesh, driven by the openai client.

The fake mesh stands in for tokenizer..detokenizer: it answers each choice of a
``GenerateRequest`` (``choices()``, as the tokenizer fans it out) on its ``reply_to`` with
``TextDeltas`` (tokens ``<choice>``, ``Hello``, `` world``, cut at
max_tokens) or an ``ErrorEvent``, chosen by keywords in the prompt: ``error429`` fails before
any token, ``fail-mid`` fails after one, ``hang`` sends one token then nothing, ``silent``
never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import nats
import openai
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from common.config import MeshConfig
from common.nats_server import LocalNatsServer
from common.runtime import RequestError
from common.subjects import Subjects
from common.wire.executor import AbortRequests
from common.wire.gateway import ErrorEvent, TextDelta, TextDeltas, TextLogprob, Usage
from common.wire.scheduler import Heartbeat
from common.wire.tokenizer import GenerateRequest, WireSamplingParams
from services.gateway import GatewayConfig, GatewayServer, parse_args
from services.gateway.body import Body, check_unicode
from services.gateway.protocol import parse_logit_bias
from services.gateway.responses import ResponseBuilder
from services.gateway.structured import parse_message_tool_calls

PROMPT_TOKENS = 7
CACHED_TOKENS = 2


class FakeMesh:
    def __init__(self, nc: Client, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self.requests: list[GenerateRequest] = []
        self.sizes: list[tuple[int, dict[str, str] | None]] = []  # (payload bytes, headers)
        self.aborts: list[AbortRequests] = []
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.nc.subscribe(self.subjects.tokenizer_encode, cb=self.on_request)
        await self.nc.subscribe(self.subjects.abort, cb=self.on_abort)
        await self.nc.flush()

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()

    async def on_abort(self, msg: Msg) -> None:
        self.aborts.append(AbortRequests.decode(msg.data))

    async def on_request(self, msg: Msg) -> None:
        request = GenerateRequest.decode(msg.data)
        self.requests.append(request)
        self.sizes.append((len(msg.data), msg.headers))
        for choice_id, params in request.choices():
            task = asyncio.create_task(self.answer(request, choice_id, params))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def beat(self, draining: bool = False) -> None:
        beat = Heartbeat("ex0", 0, 0, 100, 100, 16, 8, 0, draining, time.time())
        await self.nc.publish(self.subjects.executor_heartbeat, beat.encode())

    async def send(self, request: GenerateRequest, *events: TextDelta | ErrorEvent) -> None:
        for event in events:
            message = TextDeltas([event]) if isinstance(event, TextDelta) else event
            await self.nc.publish(request.reply_to, message.encode())
        await self.nc.flush()

    async def answer(self, request: GenerateRequest, rid: str, params: WireSamplingParams) -> None:
        text = request.prompt or ""
        if request.messages:
            text = request.messages[-1].content
        if "silent" in text:
            return
        choice = rid.rsplit("-", 1)[1]
        if "error429" in text:
            if choice == "0":  # one choice is refused (a full queue); the others never answer
                await self.send(request, ErrorEvent(rid, 429, "queue is full", "rate_limit_error"))
            return
        if "tokenizer-error" in text:  # the tokenizer fails before the request splits
            if choice == "0":
                error = ErrorEvent(request.request_id, 400, "bad template", param="messages")
                await self.send(request, error)
            return
        tokens = [f"<{choice}>", "Hello", " world"]
        if "weather" in text:  # a Llama 3.1 tool call
            tokens = ['{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}', ""]
        n = min(len(tokens), params.max_tokens)
        for i, token in enumerate(tokens[:n]):
            if i == 1 and "hang" in text:
                return
            if i == 1 and "fail-mid" in text:
                await self.send(request, ErrorEvent(rid, 500, "executor died", "server_error"))
                return
            last = i == n - 1
            await self.send(
                request,
                TextDelta(
                    rid,
                    token,
                    ("stop" if n == len(tokens) else "length") if last else None,
                    Usage(PROMPT_TOKENS, n, CACHED_TOKENS) if last else None,
                    logprobs_for(token, params.logprobs, "nonfinite" in text),
                ),
            )


def logprobs_for(token: str, top: int | None, nonfinite: bool = False) -> list[TextLogprob] | None:
    if top is None:
        return None
    if nonfinite:
        alternatives = [(token, math.nan), ("x", math.inf), ("y", -math.inf)][:top]
        return [TextLogprob(token, math.nan, list(token.encode()), alternatives)]
    alternatives = [(token, -0.5), ("x", -1.25), ("y", float("-inf"))][:top]
    return [TextLogprob(token, -0.5, list(token.encode()), alternatives)]


@dataclass
class Env:
    server: GatewayServer
    fake: FakeMesh
    url: str
    http: aiohttp.ClientSession
    client: openai.AsyncOpenAI

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.http.post(self.url + path, data=data) as resp:
            return resp.status, await resp.json()

    async def wait_for(self, predicate: Any, timeout: float = 3.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "condition not met in time"
            await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def nats_server() -> Any:
    server = LocalNatsServer.start(jetstream=False)
    yield server
    server.stop()


@contextlib.asynccontextmanager
async def running(nats_url: str, **overrides: Any) -> AsyncIterator[Env]:
    mesh = MeshConfig(nats_url, f"t{uuid.uuid4().hex[:8]}")
    settings: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "served_model_name": "smollm2"}
    settings |= {"max_model_len": 64, "max_body_bytes": 4096, "shutdown_timeout_s": 0.5}
    # The fake mesh answers for every stage without announcing any (test_health.py covers
    # stage liveness on a real mesh).
    settings["required_stages"] = ()
    config = GatewayConfig(mesh=mesh, **(settings | overrides))
    nc = await nats.connect(nats_url)
    fake = FakeMesh(nc, mesh.subjects)
    await fake.start()
    server = GatewayServer(config)
    await server.start()
    url = f"http://127.0.0.1:{server.port}"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    async with aiohttp.ClientSession() as http:
        try:
            yield Env(server, fake, url, http, client)
        finally:
            await client.close()
            await server.stop()
            await fake.stop()
            await nc.close()


@pytest.fixture
async def env(nats_server: LocalNatsServer) -> AsyncIterator[Env]:
    async with running(nats_server.url) as env:
        yield env


def sse_events(raw: str) -> list[Any]:
    """Split an SSE body into its data payloads, checking the framing on the way."""
    assert raw.endswith("data: [DONE]\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# --- completions -------------------------------------------------------------------------------


async def test_completion_non_stream(env: Env) -> None:
    before = time.time()
    result = await env.client.completions.create(model="smollm2", prompt="Say hi")
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    assert result.model == "smollm2"
    assert [(c.index, c.text, c.finish_reason) for c in result.choices] == [
        (0, "<0>Hello world", "stop")
    ]
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (PROMPT_TOKENS, 3)
    assert result.usage.total_tokens == PROMPT_TOKENS + 3
    (request,) = env.fake.requests
    assert request.request_id == result.id and request.choice_ids() == [f"{result.id}-0"]
    assert request.prompt == "Say hi" and request.prompt_token_ids is None
    assert request.params.max_tokens == 16  # OpenAI's completions default
    assert request.params.seed is None
    assert request.reply_to == env.server.mesh.inbox_subject
    assert request.deadline is not None
    assert 599 < request.deadline - before < 601
    assert env.fake.aborts == []


async def test_completion_stream_framing(env: Env) -> None:
    body = {
        "model": "smollm2",
        "prompt": [1, 2, 3],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with env.http.post(env.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        assert resp.headers["Cache-Control"] == "no-cache"
        request_id = resp.headers["X-Request-Id"]
        events = sse_events(await resp.text())
    assert env.fake.requests[0].prompt_token_ids == [1, 2, 3]
    assert env.fake.requests[0].choice_ids() == [f"{request_id}-0"]
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    for chunk in chunks:
        assert chunk["object"] == "text_completion" and chunk["model"] == "smollm2"
        assert chunk["usage"] is None
        assert set(chunk["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == "<0>Hello"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": 2,
        "total_tokens": PROMPT_TOKENS + 2,
        "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
    }


async def test_completion_stream_with_openai_client(env: Env) -> None:
    stream = await env.client.completions.create(model="smollm2", prompt="hi", stream=True)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == "<0>Hello world"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks)


async def test_completion_logprobs_format(env: Env) -> None:
    result = await env.client.completions.create(model="smollm2", prompt="hi", logprobs=2)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["<0>", "Hello", " world"]
    assert logprobs.token_logprobs == [-0.5, -0.5, -0.5]
    assert logprobs.top_logprobs == [{t: -0.5, "x": -1.25} for t in logprobs.tokens]
    assert logprobs.text_offset == [0, 3, 8]
    assert env.fake.requests[0].params.logprobs == 2
    # The sampled token is always in its map ("up to logprobs+1 elements"), even with 0.
    result = await env.client.completions.create(model="smollm2", prompt="hi", logprobs=0)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens == ["<0>", "Hello", " world"]
    assert logprobs.top_logprobs == [{t: -0.5} for t in logprobs.tokens]


async def test_n_choices_with_seed(env: Env) -> None:
    result = await env.client.completions.create(model="smollm2", prompt="hi", n=2, seed=5)
    assert sorted((c.index, c.text) for c in result.choices) == [
        (0, "<0>Hello world"),
        (1, "<1>Hello world"),
    ]
    (request,) = env.fake.requests  # one request: the tokenizer fans the choices out
    assert request.n == 2 and request.params.seed == 5
    assert [params.seed for _, params in request.choices()] == [5, 6]
    assert result.usage is not None
    assert result.usage.prompt_tokens == PROMPT_TOKENS  # the shared prompt counts once
    assert result.usage.completion_tokens == 6


# --- chat --------------------------------------------------------------------------------------


async def test_chat_stream_framing(env: Env) -> None:
    stream = await env.client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        n=2,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    *content, usage_chunk = chunks
    texts: dict[int, str] = {0: "", 1: ""}
    for index in (0, 1):
        mine = [c.choices[0] for c in content if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert mine[-1].finish_reason == "stop"
        texts[index] = "".join(c.delta.content or "" for c in mine)
    assert texts == {0: "<0>Hello world", 1: "<1>Hello world"}
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 6
    assert usage_chunk.usage.prompt_tokens_details is not None
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS


async def test_chat_non_stream_messages(env: Env) -> None:
    result = await env.client.chat.completions.create(
        model="smollm2",
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        max_completion_tokens=2,
    )
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    (choice,) = result.choices
    assert choice.message.role == "assistant" and choice.message.content == "<0>Hello"
    assert choice.finish_reason == "length"
    (request,) = env.fake.requests
    assert [(m.role, m.content) for m in request.messages or []] == [
        ("system", "be brief"),
        ("user", "a\nb"),
    ]
    assert request.params.max_tokens == 2


async def test_chat_default_max_tokens_is_rest_of_context(env: Env) -> None:
    await env.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "hi"}]
    )
    assert env.fake.requests[0].params.max_tokens == 63  # max_model_len 64 - 1


async def test_vllm_output_controls_reach_the_mesh(env: Env) -> None:
    """allowed_token_ids (deduplicated), bad_words and truncate_prompt_tokens travel to the
    tokenizer; a token prompt longer than the context fits once truncated (-1: the context)."""
    await env.client.completions.create(
        model="smollm2",
        prompt=[1] * 60,
        max_tokens=4,
        extra_body={
            "allowed_token_ids": [7, 3, 7],
            "bad_words": ["no way"],
            "truncate_prompt_tokens": 40,
        },
    )
    await env.client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=2,
        extra_body={"truncate_prompt_tokens": -1},
    )
    first, second = env.fake.requests
    assert first.params.allowed_token_ids == [3, 7] and first.bad_words == ["no way"]
    assert first.truncate_prompt_tokens == 40 and first.prompt_token_ids == [1] * 60
    assert second.truncate_prompt_tokens == 64 and second.params.allowed_token_ids == []


async def test_chat_logprobs_format(env: Env) -> None:
    result = await env.client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=3,
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    first = logprobs.content[0]
    assert (first.token, first.logprob, first.bytes) == ("<0>", -0.5, list(b"<0>"))
    assert [(t.token, t.logprob, t.bytes) for t in first.top_logprobs] == [
        ("<0>", -0.5, list(b"<0>")),
        ("x", -1.25, [120]),
        ("y", -9999.0, [121]),  # -inf is not JSON; clamped as vLLM does
    ]
    assert env.fake.requests[0].params.logprobs == 3


# --- bad input ---------------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "hi"}]
CMP, CHT = "/v1/completions", "/v1/chat/completions"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (CMP, {}, 400, "prompt"),
        (CMP, {"prompt": 5}, 400, "prompt"),
        (CMP, {"prompt": ["a", 5]}, 400, "prompt[1]"),
        (CMP, {"prompt": ["a", []]}, 400, "prompt[1]"),
        (CMP, {"prompt": [[1], ["x"]]}, 400, "prompt[1][0]"),
        (CMP, {"prompt": ["a"] * 65}, 400, "prompt"),
        (CMP, {"prompt": ["a"] * 9, "n": 8}, 400, "prompt"),  # 72 choices
        (CMP, {"prompt": [[1], [1] * 60], "max_tokens": 10}, 400, "max_tokens"),
        (CMP, {"prompt": [1, -2]}, 400, "prompt[1]"),
        (CMP, {"prompt": [1] * 60, "max_tokens": 10}, 400, "max_tokens"),
        (CMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        (CMP, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        (CMP, {"prompt": "x", "max_tokens": 64}, 400, "max_tokens"),
        (CMP, {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
        (CMP, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        (CMP, {"prompt": "x", "top_p": 0}, 400, "top_p"),
        (CMP, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
        (CMP, {"prompt": "x", "presence_penalty": -3}, 400, "presence_penalty"),
        (CMP, {"prompt": "x", "frequency_penalty": 2.1}, 400, "frequency_penalty"),
        (CMP, {"prompt": "x", "n": 0}, 400, "n"),
        (CMP, {"prompt": "x", "n": 9}, 400, "n"),
        (CMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        (CMP, {"prompt": "x", "logprobs": True}, 400, "logprobs"),
        (CMP, {"prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
        (CMP, {"prompt": "x", "stop": 3}, 400, "stop"),
        (CMP, {"prompt": "x", "stream": "yes"}, 400, "stream"),
        (CMP, {"prompt": "x", "stream_options": {}}, 400, "stream_options"),
        (
            CMP,
            {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": 1}},
            400,
            "stream_options.continuous_usage_stats",
        ),
        (CMP, {"prompt": "x", "seed": 1.5}, 400, "seed"),
        (CMP, {"prompt": "x", "user": 7}, 400, "user"),
        (CMP, {"prompt": "x", "echo": 1}, 400, "echo"),
        (CHT, {"messages": CHAT, "echo": True}, 400, "echo"),
        (CMP, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        (CMP, {"prompt": "x", "stream": True, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
        (CMP, {"prompt": "x", "top_k": -2}, 400, "top_k"),
        (CMP, {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
        (CMP, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
        (CMP, {"prompt": "x", "stop": [""]}, 400, "stop"),
        (CMP, {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
        (CMP, {"prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
        (CMP, {"prompt": "x", "include_stop_str_in_output": 1}, 400, "include_stop_str_in_output"),
        (CMP, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
        (CMP, {"prompt": "x", "allowed_token_ids": [-1]}, 400, "allowed_token_ids"),
        (CMP, {"prompt": "x", "allowed_token_ids": "5"}, 400, "allowed_token_ids"),
        (CMP, {"prompt": "x", "bad_words": "no"}, 400, "bad_words"),
        (CMP, {"prompt": "x", "bad_words": [" "]}, 400, "bad_words"),
        (CMP, {"prompt": "x", "bad_words": ["w"] * 129}, 400, "bad_words"),
        (CMP, {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
        (CMP, {"prompt": "x", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
        (CMP, {"prompt": "x", "truncate_prompt_tokens": 10**6}, 400, "truncate_prompt_tokens"),
        (CMP, {"prompt": [1] * 60, "truncate_prompt_tokens": 60}, 400, "max_tokens"),
        (CHT, {}, 400, "messages"),
        (CHT, {"messages": "hi"}, 400, "messages"),
        (CHT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
        (CHT, {"messages": [{"role": "bot", "content": "x"}]}, 400, "messages[0].role"),
        (CHT, {"messages": CHAT, "logprobs": "yes"}, 400, "logprobs"),
        (CHT, {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        (CHT, {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
        (CHT, {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        (CHT, {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
        (CHT, {"messages": CHAT, "tools": {"a": 1}}, 400, "tools"),
        (CHT, {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice"),
        (
            CHT,
            {
                "messages": CHAT,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            400,
            "tool_choice.function.name",
        ),
        (CHT, {"messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
        (CHT, {"messages": CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type"),
        (
            CHT,
            {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {}}},
            400,
            "response_format.json_schema.name",
        ),
        (CHT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
        (CMP, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
        (CMP, {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
        (CMP, {"prompt": "x", "logit_bias": [1]}, 400, "logit_bias"),
        (CMP, {"prompt": "x", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),
        (
            CHT,
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "a", "function": {"name": "f", "arguments": "[" * 3000}}
                        ],
                    },
                    {"role": "user", "content": "hi"},
                ]
            },
            400,
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            CHT,
            {
                "messages": CHAT,
                "tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}],
            },
            400,
            "tools[0].function.description",
        ),
        (
            CHT,
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "a", "function": {"name": "f", "arguments": '{"x": "\\ud800"}'}}
                        ],
                    },
                    {"role": "user", "content": "hi"},
                ]
            },
            400,
            "messages[0].tool_calls[0].function.arguments.x",
        ),
        (CHT, {"messages": CHAT, "model": "gpt-4"}, 404, "model"),
        (CMP, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ],
)
async def test_bad_input_is_an_openai_error(
    env: Env, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    got_status, answer = await env.post(path, body)
    assert got_status == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found"
    assert env.fake.requests == []  # nothing reached the mesh


@pytest.mark.parametrize("key", ["\u00b2", "\u2460", "9" * 5000, "-1", " 1", "2147483648"])
def test_a_logit_bias_key_that_is_no_token_id_is_a_400_not_a_500(key: str) -> None:
    """str.isdigit takes "²" and "①", and int() refuses more than 4300 digits: each was a 500."""
    with pytest.raises(RequestError) as info:
        parse_logit_bias(Body({"logit_bias": {key: 1}}))
    assert info.value.status == 400 and info.value.param == "logit_bias"
    assert parse_logit_bias(Body({"logit_bias": {"2147483647": -100}})) == [(2**31 - 1, -100.0)]


async def test_vllm_stop_extensions_reach_the_mesh(env: Env) -> None:
    """min_tokens and include_stop_str_in_output (vLLM's) are carried, not dropped; the vLLM
    extensions not implemented here are refused above (test_bad_input_is_an_openai_error)."""
    body = {"prompt": "hi", "max_tokens": 3, "min_tokens": 2, "include_stop_str_in_output": True}
    status, _ = await env.post("/v1/completions", body)
    assert status == 200
    params = env.fake.requests[0].params
    assert params.min_tokens == 2 and params.include_stop_str_in_output


async def test_the_tool_call_format_is_the_one_the_tokenizer_announces_at_start_up(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request in the gateway's first seconds waits in ``submit`` for a tokenizer to
    announce itself; its tool-call format was read before that wait, so a Llama 3.1 mesh
    parsed that request's call as hermes and returned it as plain content."""
    mesh = env.server.mesh
    submit = mesh.submit
    assert mesh.liveness.tool_format == "hermes"

    async def announced_while_waiting(*args: Any, **kwargs: Any) -> Any:
        mesh.liveness.tool_format = "llama3_json"  # the tokenizer's presence arrives
        return await submit(*args, **kwargs)

    monkeypatch.setattr(mesh, "submit", announced_while_waiting)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    status, body = await env.post(
        "/v1/chat/completions",
        {"model": "smollm2", "messages": [{"role": "user", "content": "weather?"}],
         "tools": [tool]},
    )  # fmt: skip
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Oslo"}


async def test_unknown_model_with_openai_client(env: Env) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await env.client.completions.create(model="nope", prompt="x")
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
async def test_malformed_body_is_400(env: Env, body: bytes) -> None:
    status, answer = await env.post("/v1/completions", body)
    assert status == 400
    assert answer["error"]["type"] == "invalid_request_error"


async def test_body_over_limit_is_413(env: Env) -> None:
    status, answer = await env.post(CMP, {"prompt": "x" * 5000})
    assert status == 413
    assert answer["error"]["code"] == "request_too_large"


async def test_unknown_route_is_an_openai_404(env: Env) -> None:
    async with env.http.get(env.url + "/v1/nothing") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "invalid_request_error"


# --- errors from the mesh, disconnects, timeouts -----------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_error_before_first_token_is_the_http_status(env: Env, stream: bool) -> None:
    status, answer = await env.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "error429"}], "stream": stream, "n": 2},
    )
    assert status == 429
    assert answer["error"] == {
        "message": "queue is full",
        "type": "rate_limit_error",
        "param": None,
        "code": None,
    }
    # The first error fails the request; every choice is aborted (the failed one too: its
    # stage may have dropped it already, but a loss in transit would leave it running).
    await env.wait_for(lambda: len(env.fake.aborts) == 1)
    assert env.fake.aborts[0].request_ids == env.fake.requests[0].choice_ids()
    # Each choice is counted once: both failed with the request.
    assert choices_counted(env) == {("failure", "429"): 2}


def choices_counted(env: Env) -> dict[tuple[str, str], float]:
    """The gateway's request_success/request_failure counts by (kind, label), nonzero ones."""
    out = {}
    for metric in env.server.mesh.service.registry.collect():
        for sample in metric.samples:
            for kind, label in (("success", "finished_reason"), ("failure", "status")):
                if sample.name == f"meshserve:request_{kind}_total" and sample.value:
                    out[(kind, sample.labels[label])] = sample.value
    return out


@pytest.mark.parametrize(
    ("stream", "failing", "status"), [(True, "fail-mid", "500"), (False, "error429", "429")]
)
async def test_one_failed_prompt_fails_the_whole_batch(
    env: Env, stream: bool, failing: str, status: str
) -> None:
    """A batch whose second prompt fails: the first prompt's choice (still generating) fails
    with it, counted as the batch's failure and aborted for that reason, not for a client that
    left."""
    body = {"prompt": ["hang", failing], "stream": stream, "max_tokens": 3}
    async with env.http.post(env.url + "/v1/completions", json=body) as resp:
        await resp.read()
    await env.wait_for(lambda: len(env.fake.aborts) == 2)
    assert choices_counted(env) == {("failure", status): 2}
    first = next(a for a in env.fake.aborts if a.request_ids[0].endswith("-0-0"))
    assert first.reason.startswith("prompt 1 of the batch failed")


async def test_a_prompt_the_gateway_cannot_publish_fails_the_batch_with_its_503(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second prompt's publish fails: the client gets the 503, and both prompts' choices
    are counted with it (the refused one was counted as a 500 of the gateway's own), the
    first aborted as the batch's failure."""
    nc = env.server.mesh.service.nc
    real = nc.publish

    async def publish(subject: str, payload: bytes = b"", **kwargs: Any) -> None:
        if b"unpublishable" in payload:
            raise ConnectionResetError("the bus went away")
        await real(subject, payload, **kwargs)

    monkeypatch.setattr(nc, "publish", publish)
    status, answer = await env.post(CMP, {"prompt": ["hang", "unpublishable"], "max_tokens": 3})
    assert status == 503
    assert answer["error"]["message"] == "The gateway could not reach the mesh."
    await env.wait_for(lambda: any(a.request_ids[0].endswith("-0-0") for a in env.fake.aborts))
    assert choices_counted(env) == {("failure", "503"): 2}
    first = next(a for a in env.fake.aborts if a.request_ids[0].endswith("-0-0"))
    assert first.reason.startswith("prompt 1 of the batch was refused")


async def test_an_error_for_the_whole_request_fails_every_choice(env: Env) -> None:
    """The tokenizer answers under the request's own id (it failed before the fan-out, or
    while forwarding): the request fails, and every choice is aborted in case some went on."""
    status, answer = await env.post(CMP, {"prompt": "tokenizer-error", "n": 3})
    assert status == 400
    assert answer["error"]["message"] == "bad template"
    assert answer["error"]["param"] == "messages"
    await env.wait_for(lambda: len(env.fake.aborts) == 1)
    (request,) = env.fake.requests
    assert sorted(env.fake.aborts[0].request_ids) == sorted(request.choice_ids())
    assert len(env.server.mesh.inbox) == 0


async def test_error_before_first_token_with_openai_client(env: Env) -> None:
    with pytest.raises(openai.RateLimitError):
        await env.client.completions.create(model="smollm2", prompt="error429", stream=True)


async def test_error_mid_stream_is_an_error_chunk(env: Env) -> None:
    body = {"prompt": "fail-mid", "stream": True}
    async with env.http.post(env.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        events = sse_events(await resp.text())
    first, error, done = events
    assert first["choices"][0]["text"] == "<0>"
    assert error == {
        "error": {
            "message": "executor died",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    assert done == "[DONE]"
    with pytest.raises(openai.APIError, match="executor died"):
        stream = await env.client.completions.create(
            model="smollm2", prompt="fail-mid", stream=True
        )
        async for _ in stream:
            pass


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_aborts_the_request(env: Env, stream: bool) -> None:
    body = {"prompt": "hang", "stream": stream, "n": 2}
    if stream:
        async with env.http.post(env.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # the first token arrived; now leave
    else:
        with pytest.raises(asyncio.TimeoutError):
            timeout = aiohttp.ClientTimeout(total=0.3)
            await env.http.post(env.url + "/v1/completions", json=body, timeout=timeout)
    await env.wait_for(lambda: len(env.fake.aborts) == 1)
    (abort,) = env.fake.aborts
    (request,) = env.fake.requests
    assert sorted(abort.request_ids) == sorted(request.choice_ids())
    assert abort.reason == "client disconnected"
    assert len(env.server.mesh.inbox) == 0  # nothing left routed to the dead request
    assert choices_counted(env) == {("success", "abort"): 2}  # vLLM's count of a client gone


async def test_a_write_to_a_client_that_just_left_is_a_disconnect_not_an_error(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The client can close between two tokens before aiohttp cancels the handler: the next
    write then fails. That is a disconnect (abort, no error log), not a failed stream."""
    original = aiohttp.web.StreamResponse.write
    writes = 0

    async def write(self: aiohttp.web.StreamResponse, data: bytes) -> None:
        nonlocal writes
        writes += 1
        if writes > 1:
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        await original(self, data)

    monkeypatch.setattr(aiohttp.web.StreamResponse, "write", write)
    body = {"prompt": "hi", "stream": True}
    with contextlib.suppress(aiohttp.ClientError):
        async with env.http.post(env.url + "/v1/completions", json=body) as resp:
            await resp.read()
    await env.wait_for(lambda: len(env.fake.aborts) == 1)
    assert env.fake.aborts[0].reason == "client disconnected"
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    monkeypatch.undo()
    assert (await env.post(CMP, {"prompt": "hi"}))[0] == 200  # and it keeps serving


async def test_timeout_is_504_and_aborts(nats_server: LocalNatsServer) -> None:
    async with running(nats_server.url, request_timeout_s=0.3) as env:
        status, answer = await env.post(CMP, {"prompt": "silent"})
        assert status == 504
        assert answer["error"]["code"] == "request_timeout"
        body = {"prompt": "hang", "stream": True}
        async with env.http.post(env.url + "/v1/completions", json=body) as resp:
            _, error, done = sse_events(await resp.text())
        assert error["error"]["code"] == "request_timeout" and done == "[DONE]"
        await env.wait_for(lambda: len(env.fake.aborts) == 2)
        assert {a.reason for a in env.fake.aborts} == {"request timed out"}


async def test_shutdown_aborts_requests_that_outlast_the_grace_period(
    nats_server: LocalNatsServer,
) -> None:
    async with running(nats_server.url, shutdown_timeout_s=0.2) as env:
        body = {"prompt": "hang", "stream": True}
        async with env.http.post(env.url + "/v1/completions", json=body) as resp:
            await resp.content.readuntil(b"\n\n")
            await env.server.stop()
        await env.wait_for(lambda: len(env.fake.aborts) == 1)
        assert env.fake.aborts[0].reason == "gateway shutting down"


async def test_unexpected_exception_is_500_and_gateway_keeps_serving(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: ResponseBuilder) -> dict[str, Any]:
        raise RuntimeError("bug")

    with monkeypatch.context() as patch:
        patch.setattr(ResponseBuilder, "response", broken)
        status, answer = await env.post(CMP, {"prompt": "hi"})
    assert status == 500
    assert answer["error"]["type"] == "server_error"
    status, answer = await env.post(CMP, {"prompt": "hi"})
    assert status == 200 and answer["choices"][0]["text"] == "<0>Hello world"


# --- health, models, config --------------------------------------------------------------------


async def test_health_needs_a_recent_executor_heartbeat(nats_server: LocalNatsServer) -> None:
    async with running(nats_server.url, heartbeat_ttl_s=0.5, required_stages=("executor",)) as env:
        async with env.http.get(env.url + "/health") as resp:
            assert resp.status == 503
            assert "heartbeat" in (await resp.json())["reason"]
        await env.fake.beat()
        await env.fake.nc.flush()
        await env.wait_for(lambda: env.server.mesh.health_problem() is None)
        async with env.http.get(env.url + "/health") as resp:
            assert resp.status == 200
            assert (await resp.json())["status"] == "ok"
        await asyncio.sleep(0.6)  # the heartbeat expires
        async with env.http.get(env.url + "/health") as resp:
            assert resp.status == 503


async def test_models(env: Env) -> None:
    models = await env.client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    assert (await env.client.models.retrieve("smollm2")).id == "smollm2"


async def test_api_keys(nats_server: LocalNatsServer) -> None:
    async with running(nats_server.url, api_keys=("secret",), required_stages=("executor",)) as env:
        with pytest.raises(openai.AuthenticationError):
            await env.client.models.list()
        good = openai.AsyncOpenAI(base_url=env.url + "/v1", api_key="secret", max_retries=0)
        assert [m.id async for m in good.models.list()] == ["smollm2"]
        await good.close()
        async with env.http.get(env.url + "/health") as resp:  # health needs no key
            assert resp.status == 503


def test_parse_args_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_MAX_N", "3")
    monkeypatch.setenv("MESHSERVE_API_KEYS", "a,b")
    flags = "--nats-url nats://h:1 --port 9000 --served-model-name m --max-model-len 128"
    config = parse_args(flags.split())
    assert (config.mesh.nats_url, config.port, config.served_model_name) == (
        "nats://h:1",
        9000,
        "m",
    )
    assert (config.max_model_len, config.max_n, config.api_keys) == (128, 3, ("a", "b"))
    assert config.chat_default_max_tokens == 127
    assert "api_keys" not in repr(config)  # secrets stay out of the start-up log
    with pytest.raises(ValueError, match="max_n"):
        GatewayConfig(max_n=0)


def test_tool_call_arguments_nested_near_the_decoders_limit_are_a_400_or_accepted() -> None:
    """Arguments the JSON decoder just accepts are nested three levels deeper once in the
    turn's tool calls: that must not be a RecursionError (a 500)."""
    limit = sys.getrecursionlimit()
    outcomes = set()
    for depth in range(limit - 200, limit + 20):
        call = {"id": "a", "function": {"name": "f", "arguments": "[" * depth + "]" * depth}}
        try:
            parse_message_tool_calls([call], "messages[0].tool_calls")
            outcomes.add("accepted")
        except RequestError as exc:
            assert exc.status == 400 and exc.param is not None
            assert exc.param.startswith("messages[0].tool_calls")
            outcomes.add(str(exc))
    assert "accepted" in outcomes and len(outcomes) >= 2  # the window was crossed


def test_the_body_check_for_lone_surrogates_builds_no_path_per_element() -> None:
    """Any escaped emoji sends a body through the check: a wide one (a long key over a
    million-element list) must not cost a path string per element (gigabytes)."""
    import tracemalloc

    inner = ["a", "b"]
    body: dict[str, Any] = {"k" * 10_000: [0] * 200_000, "ok": "\U0001f600", "x": [{"y": inner}]}
    tracemalloc.start()
    check_unicode(body)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 20_000_000, peak
    inner[1] = "\udc00"
    with pytest.raises(RequestError) as info:
        check_unicode(body)
    assert info.value.param == "x[0].y[1]"


async def test_a_client_that_stops_reading_is_taken_as_gone(monkeypatch) -> None:
    """Its connection open and its window full, the handler waited on the write forever: the
    request was never released nor aborted. A write that cannot finish in time now ends the
    stream as a client leaving does (the handler's release aborts what runs)."""
    import asyncio

    from services.gateway import app

    class Stuck:
        async def write(self, data: bytes) -> None:
            await asyncio.Event().wait()

    monkeypatch.setattr(app, "WRITE_TIMEOUT_S", 0.05)
    with pytest.raises(ConnectionResetError, match="read nothing"):
        await app.send(Stuck(), b"data: {}\n\n")  # type: ignore[arg-type]
