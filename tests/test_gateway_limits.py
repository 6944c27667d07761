"""Client input that must never become a 5xx or invalid JSON, and the gateway's limits.

Every test asserts the HTTP status and the whole OpenAI error object, then that the gateway
still serves. They run against the fake mesh of ``tests.test_gateway_unit`` (a real
nats-server, no model); the payload tests start nats-servers of their own, one of them with a
small ``max_payload``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from common.nats_server import LocalNatsServer
from common.telemetry import extract, inject
from services.gateway import GatewayConfig, parse_args
from services.gateway.config import build_parser
from services.gateway.observe import MAX_TRACESTATE_CHARS, trace_headers, trim_tracestate
from services.gateway.responses import dump_json
from tests.test_gateway_unit import CHAT, CHT, CMP, Env, running

SMALL_PAYLOAD = 8192  # max_payload of the small_nats server, headers included


@pytest.fixture(scope="module")
def nats_server() -> Iterator[LocalNatsServer]:
    server = LocalNatsServer.start(jetstream=False)  # the default max_payload, 1 MiB
    yield server
    server.stop()


@pytest.fixture(scope="module")
def small_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNatsServer]:
    conf = tmp_path_factory.mktemp("nats") / "small.conf"
    conf.write_text(f"max_payload: {SMALL_PAYLOAD}\n")
    server = LocalNatsServer.start(jetstream=False, extra_args=["-c", str(conf)])
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
        (CMP, b'{"prompt": "x", "stop": ["\\ud800"]}', "stop[0]"),
        (
            CHT,
            b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
            b'"function": {"name": "f", "description": "\xed\xa0\x80"}}]}',
            "tools[0].function.description",
        ),
        (
            CHT,
            b'{"messages": [{"role": "user", "content": "x", "name": "\\ud800"}]}',
            "messages[0].name",
        ),
        (
            CHT,
            b'{"messages": [{"role": "tool", "content": "x", "tool_call_id": "\\udc00"}]}',
            "messages[0].tool_call_id",
        ),
        (
            CHT,
            b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": '
            b'"json_schema", "json_schema": {"name": "\\ud800", "schema": {}}}}',
            "response_format.json_schema.name",
        ),
    ],
    ids=["prompt", "messages", "stop", "raw-bytes", "name", "tool_call_id", "schema-name"],
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


# --- 2: what fits on the bus --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CMP, {"prompt": "x" * 2_000_000}, "prompt"),
        (CHT, {"messages": [{"role": "user", "content": "x" * 2_000_000}]}, "messages"),
        (CMP, {"prompt": list(range(300_000)), "max_tokens": 1}, "prompt"),
    ],
    ids=["prompt", "messages", "token-ids"],
)
async def test_body_over_the_bus_limit_is_413_not_503(
    nats_server: LocalNatsServer, path: str, body: dict[str, Any], param: str
) -> None:
    """Under --max-body-bytes but over NATS' max_payload (1 MiB): a 413 that SDKs do not retry,
    where it used to be a 503 with Retry-After that they retried forever."""
    limit = 1024 * 1024
    async with running(nats_server.url, max_body_bytes=4 << 20, max_model_len=1 << 20) as env:
        assert env.server.mesh.service.nc.max_payload == limit
        status, answer, headers = await post_raw(env, path, body)
        assert status == 413, answer
        assert "Retry-After" not in headers
        error = answer["error"]
        assert error["message"].startswith("The request is too large for the message bus:")
        assert f"over its limit of {limit} bytes" in error["message"]
        assert error | {"message": ""} == invalid("", param, "request_too_large")["error"]
        assert env.fake.requests == []  # rejected before it entered the mesh
        await still_serving(env)


async def calibrate(env: Env) -> int:
    """Bytes a completion request encodes to besides its prompt (measured, not guessed)."""
    status, _ = await env.post(CMP, {"prompt": "x" * 100})
    assert status == 200
    size, _ = env.fake.sizes[-1]
    return size - 100


TRACEPARENT = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
MEMBERS = [f"k{i:02d}=" + "v" * 120 for i in range(32)]  # 124 characters each
TRACESTATE = ",".join(MEMBERS)  # 3999 characters: valid for OpenTelemetry (<= 8192, 32 keys)


async def test_near_limit_prompt_with_a_large_tracestate_is_served(
    small_nats: LocalNatsServer,
) -> None:
    """The client's tracestate is copied into the NATS headers of every hop; trimmed to W3C's
    512 characters it leaves room for the prompt, where the full one made nats-server drop the
    connection (max_payload counts headers too) and every in-flight request fail with 503."""
    async with running(small_nats.url, max_body_bytes=64 << 10) as env:
        overhead = await calibrate(env)
        prompt = "x" * (SMALL_PAYLOAD - overhead - 700)  # the trimmed headers take < 700
        trace = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
        status, answer, _ = await post_raw(env, CMP, {"prompt": prompt}, **trace)
        assert status == 200, answer
        size, headers = env.fake.sizes[-1]
        assert headers is not None
        assert headers["tracestate"] == ",".join(MEMBERS[:4])  # 499 chars; 5 members: 624
        assert headers["traceparent"].split("-")[1] == "ab" * 16  # the client's trace goes on
        assert size + len(TRACESTATE) > SMALL_PAYLOAD  # untrimmed, it would not have fitted
        await still_serving(env)


async def test_headers_count_towards_the_bus_limit(small_nats: LocalNatsServer) -> None:
    """A prompt that fits alone but not with its trace headers is a 413, and the connection to
    NATS survives (a message over max_payload makes nats-server close it)."""
    async with running(small_nats.url, max_body_bytes=64 << 10) as env:
        overhead = await calibrate(env)
        prompt = "x" * (SMALL_PAYLOAD - overhead - 40)  # fits, but not with ~600 header bytes
        trace = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
        status, answer, _ = await post_raw(env, CMP, {"prompt": prompt}, **trace)
        assert status == 413, answer
        assert answer["error"]["code"] == "request_too_large"
        assert f"over its limit of {SMALL_PAYLOAD} bytes" in answer["error"]["message"]
        status, answer, _ = await post_raw(env, CMP, {"prompt": "x" * 9000})
        assert status == 413 and answer["error"]["param"] == "prompt"
        assert env.server.mesh.service.nc.is_connected
        await still_serving(env)


def test_trim_tracestate_follows_w3c() -> None:
    assert trim_tracestate([]) is None
    assert trim_tracestate(["a=1, b=2", "c=3"]) == "a=1,b=2,c=3"  # fields join with ","
    assert trim_tracestate([",,a=1, \t ,"]) == "a=1"
    many = [f"k{i}=v" for i in range(40)]
    assert trim_tracestate([",".join(many)]) == ",".join(many[:32])  # at most 32 members
    # Over 512 characters: members longer than 128 go first (from the end), then the last ones.
    big = ["a=" + "x" * 200, "b=1", "c=" + "y" * 150, "d=" + "z" * 250]
    assert trim_tracestate([",".join(big)]) == ",".join(big[:3])
    long_first = ["a=" + "x" * 300, *MEMBERS[:5]]  # without the long one still 624 characters
    assert trim_tracestate([",".join(long_first)]) == ",".join(MEMBERS[:4])
    assert trim_tracestate([",".join(MEMBERS)]) == ",".join(MEMBERS[:4])
    assert len(",".join(MEMBERS[:4])) <= MAX_TRACESTATE_CHARS < len(",".join(MEMBERS[:5]))


def test_trace_headers_copy_only_bounded_trace_context() -> None:
    assert trace_headers(
        {"traceparent": TRACEPARENT, "tracestate": TRACESTATE, "x-other": "1"}
    ) == {
        "traceparent": TRACEPARENT,
        "tracestate": ",".join(MEMBERS[:4]),
    }
    assert trace_headers({"traceparent": "0" * 600}) == {}
    assert trace_headers({}) == {}
    # A malformed member (here a byte that was not UTF-8) voids the whole tracestate, as
    # OpenTelemetry has it, so what reaches the NATS headers is always ASCII.
    bad = trace_headers({"traceparent": TRACEPARENT, "tracestate": "a=1,b=\udcff"})
    assert inject(None, extract(bad)) == {"traceparent": TRACEPARENT}


# --- 2: stop strings and stop token ids ---------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"stop": ["s"] * 17}, "stop", "'stop' may hold at most 16 sequences, got 17."),
        (
            {"stop": ["a", "x" * 1025]},
            "stop",
            "Each 'stop' sequence may be at most 1024 characters, got 1025 in stop[1].",
        ),
        (
            {"stop": ["x" * 1000] * 5},
            "stop",
            "The 'stop' sequences may hold at most 4096 characters in all, got 5000.",
        ),
        (
            {"stop_token_ids": list(range(257))},
            "stop_token_ids",
            "'stop_token_ids' may hold at most 256 token ids, got 257.",
        ),
    ],
    ids=["count", "length", "total", "token-ids"],
)
async def test_stop_limits_are_400s(
    nats_server: LocalNatsServer, body: dict[str, Any], param: str, message: str
) -> None:
    async with running(nats_server.url, max_body_bytes=64 << 10) as env:
        status, answer, _ = await post_raw(env, CMP, {"prompt": "x", **body})
        assert status == 400
        assert answer == invalid(message, param, "invalid_value")
        assert env.fake.requests == []
        await still_serving(env)


async def test_stops_up_to_the_limits_are_accepted(nats_server: LocalNatsServer) -> None:
    stops = [f"{i:02d}" + "x" * 254 for i in range(16)]  # 16 x 256 = 4096 characters
    body = {"prompt": "x", "stop": stops, "stop_token_ids": list(range(256))}
    async with running(nats_server.url, max_body_bytes=64 << 10) as env:
        status, answer, _ = await post_raw(env, CMP, body)
        assert status == 200, answer
        (request,) = env.fake.requests
        assert request.params.stop == stops and len(request.params.stop_token_ids) == 256
        single = {"prompt": "x", "stop": "y" * 1024}
        assert (await post_raw(env, CMP, single))[0] == 200


# --- 3: priority --------------------------------------------------------------------------------


@pytest.mark.parametrize("priority", [-10, -1, 0, 3, 10])
async def test_priority_in_range_is_forwarded(env: Env, priority: int) -> None:
    status, _, _ = await post_raw(env, CHT, {"messages": CHAT, "priority": priority})
    assert status == 200
    assert env.fake.requests[0].priority == priority


@pytest.mark.parametrize("priority", [11, -11, 2**31, -(2**40)])
async def test_priority_out_of_range_is_a_400(env: Env, priority: int) -> None:
    status, answer, _ = await post_raw(env, CMP, {"prompt": "x", "priority": priority})
    assert status == 400
    assert answer == invalid(
        f"'priority' must be an integer between -10 and 10 (a lower value runs first), "
        f"got {priority}.",
        "priority",
        "invalid_value",
    )
    assert env.fake.requests == []
    await still_serving(env)


@pytest.mark.parametrize("priority", [1.5, "1", True, [1]])
async def test_priority_must_be_an_integer(env: Env, priority: Any) -> None:
    status, answer, _ = await post_raw(env, CMP, {"prompt": "x", "priority": priority})
    assert status == 400
    assert answer["error"]["param"] == "priority"
    assert answer["error"]["code"] == "invalid_type"
    await still_serving(env)


async def test_priority_zero_limit_disables_client_priorities(
    nats_server: LocalNatsServer,
) -> None:
    async with running(nats_server.url, max_client_priority=0) as env:
        for priority in (1, -1):
            status, answer, _ = await post_raw(env, CMP, {"prompt": "x", "priority": priority})
            assert status == 400
            assert answer == invalid(
                "Request priorities are disabled on this server: omit 'priority' or send 0, "
                f"got {priority}.",
                "priority",
                "unsupported_parameter",
            )
        assert env.fake.requests == []
        status, _, _ = await post_raw(env, CMP, {"prompt": "x", "priority": 0})
        assert status == 200 and env.fake.requests[0].priority == 0
        await still_serving(env)


def test_max_client_priority_flag_env_and_check(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args([]).max_client_priority == 10
    monkeypatch.setenv("MESHSERVE_MAX_CLIENT_PRIORITY", "5")
    assert parse_args([]).max_client_priority == 5
    assert parse_args(["--max-client-priority", "0"]).max_client_priority == 0  # flags win
    help_text = " ".join(build_parser().format_help().split())
    assert "lower value runs first" in help_text
    with pytest.raises(ValueError, match="max_client_priority"):
        GatewayConfig(max_client_priority=-1)


async def test_a_client_that_never_finishes_its_headers_is_disconnected(
    nats_server: LocalNatsServer,
) -> None:
    """--http-idle-timeout-s bounds the header read (bytes that trickle in do not extend it)
    and the idle wait; a request in flight longer than it is not cut."""
    async with running(nats_server.url, http_idle_timeout_s=0.5) as env:
        reader, writer = await asyncio.open_connection("127.0.0.1", env.server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for _ in range(20):  # a header every 0.2 s for 4 s: the headers never end
            await asyncio.sleep(0.2)
            try:
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()
            except ConnectionError:
                closed = True
                break
            if reader.at_eof():
                closed = True
                break
        writer.close()
        assert closed  # the gateway hung up long before the client stopped trickling
        body = {"prompt": "hang", "stream": True, "max_tokens": 3}
        async with env.http.post(env.url + CMP, json=body) as resp:
            assert resp.status == 200
            assert (await resp.content.readline()).startswith(b"data: ")
            await asyncio.sleep(1.5)  # three timeouts' worth of waiting for the next token
            assert resp.connection is not None and not resp.content.at_eof()
        await still_serving(env)
