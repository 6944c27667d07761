"""Client input that must never become a 5xx or invalid JSON, and the gateway's limits.

Every test asserts the HTTP status and the whole OpenAI error object, then that the gateway
still serves. They run against the fake mesh of ``tests.test_gateway_unit`` (a real
nats-server, no model).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from common.nats_server import LocalNatsServer
from services.gateway.responses import dump_json
from tests.test_gateway_unit import CHT, CMP, Env, running


@pytest.fixture(scope="module")
def nats_server() -> Iterator[LocalNatsServer]:
    server = LocalNatsServer.start(jetstream=False)  # the default max_payload, 1 MiB
    yield server
    server.stop()


@pytest.fixture
async def env(nats_server: LocalNatsServer) -> AsyncIterator[Env]:
    async with running(nats_server.url) as env:
        yield env


def strict_loads(text: str | bytes) -> Any:
    """``json.loads`` that refuses the NaN / Infinity Python's json accepts by default."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


async def post_raw(env: Env, path: str, body: Any, **headers: str) -> tuple[int, Any, Any]:
    """POST and parse the answer strictly: (status, body, response headers)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with env.http.post(env.url + path, data=data, headers=headers) as resp:
        return resp.status, strict_loads(await resp.read()), resp.headers


async def still_serving(env: Env) -> None:
    status, answer = await env.post(CMP, {"prompt": "hi"})
    assert status == 200 and answer["choices"][0]["text"] == "<0>Hello world"


def invalid(message: str, param: str | None, code: str) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


async def raw_http(port: int, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` as the exact bytes given (aiohttp's client would re-encode headers)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


# --- 1a: nesting --------------------------------------------------------------------------------

NESTED = [
    b"[" * 100_000,
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
]


@pytest.mark.parametrize("body", NESTED, ids=["open-arrays", "closed-objects", "in-prompt"])
async def test_deeply_nested_json_is_a_400(nats_server: LocalNatsServer, body: bytes) -> None:
    async with running(nats_server.url, max_body_bytes=1 << 20) as env:
        status, answer, _ = await post_raw(env, CMP, body)
        assert status == 400
        assert answer == invalid(
            "We could not parse the JSON body of your request (it is nested too deeply).",
            None,
            "invalid_json",
        )
        assert env.fake.requests == []
        await still_serving(env)


# --- 1b: the Authorization header ---------------------------------------------------------------


@pytest.mark.parametrize(
    "value", [b"Bearer \xff\xfe", b"Bearer s\xc3\xa9cret", b"Bearer \xe9", b"\xff"]
)
async def test_non_utf8_or_non_ascii_api_key_is_401(
    nats_server: LocalNatsServer, value: bytes
) -> None:
    async with running(nats_server.url, api_keys=("secret",)) as env:
        request = (
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: "
            + value
            + b"\r\n\r\n"
        )
        status, body = await raw_http(env.server.port, request)
        assert status == 401
        assert strict_loads(body) == invalid("Incorrect API key provided.", None, "invalid_api_key")
        good = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        status, body = await raw_http(
            env.server.port, good + b"Authorization: Bearer secret\r\n\r\n"
        )
        assert status == 200 and strict_loads(body)["data"][0]["id"] == "smollm2"


# --- 1c: non-finite numbers ---------------------------------------------------------------------


@pytest.mark.parametrize("value", [1e-30, 1e-40, 5e-324, 0.0099])
async def test_vanishing_repetition_penalty_is_a_400(env: Env, value: float) -> None:
    status, answer, _ = await post_raw(env, CMP, {"prompt": "x", "repetition_penalty": value})
    assert status == 400
    assert answer == invalid(
        f"'repetition_penalty' must be in [0.01, 2], got {value!r}.",
        "repetition_penalty",
        "invalid_value",
    )
    assert env.fake.requests == []
    status, answer, _ = await post_raw(env, CMP, {"prompt": "x", "repetition_penalty": 0.01})
    assert status == 200
    assert env.fake.requests[0].params.repetition_penalty == 0.01


async def test_nan_and_infinite_logprobs_are_finite_json(env: Env) -> None:
    """NaN and -inf become the -9999.0 floor (vLLM's and OpenAI's stand-in for -inf), +inf 0.0
    (no logprob exceeds 0), in every response shape; the bodies are strict JSON."""
    body = {"messages": [{"role": "user", "content": "nonfinite"}], "logprobs": True}
    status, answer, _ = await post_raw(env, CHT, body | {"top_logprobs": 3})
    assert status == 200
    first = answer["choices"][0]["logprobs"]["content"][0]
    assert (first["token"], first["logprob"]) == ("<0>", -9999.0)
    assert [(t["token"], t["logprob"]) for t in first["top_logprobs"]] == [
        ("<0>", -9999.0),
        ("x", 0.0),
        ("y", -9999.0),
    ]
    stream = {"prompt": "nonfinite", "logprobs": 2, "stream": True}
    async with env.http.post(env.url + CMP, json=stream) as resp:
        raw = (await resp.read()).decode()
    assert resp.status == 200 and raw.endswith("data: [DONE]\n\n")
    chunks = [strict_loads(block.removeprefix("data: ")) for block in raw.split("\n\n")[:-2]]
    logprobs = chunks[0]["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [-9999.0]
    assert logprobs["top_logprobs"] == [{"<0>": -9999.0, "x": 0.0}]
    await still_serving(env)


def test_dump_json_is_strict_and_valid_utf8() -> None:
    payload = {"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": {"d": 2}}
    assert strict_loads(dump_json(payload)) == {"a": None, "b": [None, None, 1.5], "c": {"d": 2}}
    assert dump_json({"t": "é"}) == '{"t":"é"}'.encode()  # UTF-8, not \u escapes
    # A lone surrogate (JSON may spell one as "\ud800") cannot be UTF-8: it stays escaped.
    assert strict_loads(dump_json({"t": "\ud800x"})) == {"t": "\ud800x"}


async def test_error_echoing_a_lone_surrogate_is_valid_json(env: Env) -> None:
    body = b'{"messages": [{"role": "\\ud800", "content": "x"}]}'
    status, answer, _ = await post_raw(env, CHT, body)
    assert status == 400 and answer["error"]["param"] == "messages[0].role"
    await still_serving(env)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CMP, b'{"prompt": "a\\ud800"}', "prompt"),
        (CHT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
        (CMP, b'{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
    ],
    ids=["prompt", "messages", "stop"],
)
async def test_lone_surrogate_in_forwarded_text_is_a_400(
    env: Env, path: str, body: bytes, param: str
) -> None:
    """Valid JSON, but no Unicode text: msgpack cannot encode it (it was a 503)."""
    status, answer, _ = await post_raw(env, path, body)
    assert status == 400
    assert answer["error"]["param"] == param and answer["error"]["code"] == "invalid_value"
    assert "lone surrogate" in answer["error"]["message"]
    assert env.fake.requests == []
    await still_serving(env)
