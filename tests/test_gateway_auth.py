"""The gateway's secure defaults: no unauthenticated API on a public address unless asked for,
and /metrics behind the same API keys as /v1 (no NATS needed: the routes are all it takes).

- the process's ``serving_config`` refuses a non-loopback --host without API keys (exit status
  2, the message says how to fix it), and accepts keys, a loopback host, or
  --allow-unauthenticated / MESHSERVE_ALLOW_UNAUTHENTICATED=1; ``python -m services.gateway``
  itself exits so;
- with keys, /metrics answers 401 without or with a wrong key and 200 with one; without keys
  it is open. (/health stays open with keys: tests/test_gateway_unit.py::test_api_keys.)
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.config import MeshConfig
from services.gateway.app import build_app
from services.gateway.config import GatewayConfig, is_loopback, parse_args, serving_config
from services.gateway.mesh_client import MeshClient

Client = TestClient[web.Request, web.Application]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("API_KEYS", "ALLOW_UNAUTHENTICATED", "HOST"):
        monkeypatch.delenv(f"MESHSERVE_{name}", raising=False)


def test_a_public_address_without_api_keys_is_refused(capsys: pytest.CaptureFixture[str]):
    for argv in ([], ["--host", "0.0.0.0"], ["--host", "::"], ["--host", "gateway.example"]):
        with pytest.raises(SystemExit) as exited:
            serving_config(argv)
        assert exited.value.code == 2
        message = capsys.readouterr().err
        assert "refusing to serve without API keys" in message
        assert "MESHSERVE_API_KEYS" in message and "--allow-unauthenticated" in message


def test_the_gateway_process_exits_without_api_keys_on_a_public_address():
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    environ["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "services.gateway", "--nats-url", "nats://127.0.0.1:9"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "refusing to serve without API keys on 0.0.0.0" in done.stderr


def test_keys_loopback_or_an_explicit_opt_out_start(monkeypatch: pytest.MonkeyPatch):
    assert serving_config(["--api-key", "k1"]).api_keys == ("k1",)
    for host in ("127.0.0.1", "::1", "localhost"):
        config = serving_config(["--host", host])
        assert config.api_keys == () and not config.allow_unauthenticated
    assert serving_config(["--allow-unauthenticated"]).allow_unauthenticated
    monkeypatch.setenv("MESHSERVE_ALLOW_UNAUTHENTICATED", "1")
    assert serving_config([]).allow_unauthenticated
    monkeypatch.setenv("MESHSERVE_ALLOW_UNAUTHENTICATED", "0")
    monkeypatch.setenv("MESHSERVE_API_KEYS", "a, b")
    config = serving_config([])
    assert config.api_keys == ("a", "b") and not config.allow_unauthenticated
    assert not is_loopback("0.0.0.0") and is_loopback("127.0.0.2")
    # Parsing alone refuses nothing (tests and tools build configs from it); starting does.
    monkeypatch.setenv("MESHSERVE_API_KEYS", "")
    assert parse_args([]).host == "0.0.0.0"


async def client_for(keys: tuple[str, ...]) -> AsyncIterator[Client]:
    config = GatewayConfig(mesh=MeshConfig(instance_id="gw-auth"), host="127.0.0.1", api_keys=keys)
    async with TestClient(TestServer(build_app(config, MeshClient(config)))) as client:
        yield client


@pytest.fixture
async def with_keys() -> AsyncIterator[Client]:
    async for client in client_for(("k1", "k2")):
        yield client


@pytest.fixture
async def without_keys() -> AsyncIterator[Client]:
    async for client in client_for(()):
        yield client


async def test_metrics_need_an_api_key_when_keys_are_set(with_keys: Client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer "}):
        async with with_keys.get("/metrics", headers=headers) as resp:
            assert resp.status == 401, headers
            assert (await resp.json())["error"]["code"] == "invalid_api_key"
    for key in ("k1", "k2"):
        async with with_keys.get("/metrics", headers={"Authorization": f"Bearer {key}"}) as resp:
            assert resp.status == 200
            assert "meshserve:" in await resp.text()


async def test_metrics_are_open_without_keys(without_keys: Client):
    async with without_keys.get("/metrics") as resp:
        assert resp.status == 200


async def test_the_bearer_scheme_is_read_as_rfc_9110_says(with_keys: Client):
    """The scheme is case-insensitive ("bearer k1" was a 401), and a header without one is no
    bearer token (a bare "k1" was accepted)."""
    for header, status in (
        ("bearer k1", 200), ("BEARER  k2", 200), ("Bearer k1", 200),
        ("k1", 401), ("Basic k1", 401), ("Bearer", 401),
    ):  # fmt: skip
        async with with_keys.get("/metrics", headers={"Authorization": header}) as resp:
            assert resp.status == status, header


async def test_cross_site_simple_bodies_are_refused(without_keys: Client):
    """A web page can POST text/plain or a form to a local server without asking first (no
    CORS preflight): parsed as JSON, it spent the mesh for any site the user opened."""
    body = '{"prompt": "x", "max_tokens": 4}'
    for content_type in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded"):
        headers = {"Content-Type": content_type, "Origin": "https://elsewhere.example"}
        async with without_keys.post("/v1/completions", data=body, headers=headers) as resp:
            assert resp.status == 415, content_type
            error = (await resp.json())["error"]
            assert (
                error["code"] == "unsupported_media_type" and "application/json" in error["message"]
            )


async def test_a_clients_request_id_comes_back_on_every_response(without_keys: Client):
    """vLLM echoes X-Request-Id (--enable-request-id-headers); errors carried none at all,
    and the OpenAI SDK's APIStatusError.request_id was always None."""
    headers = {"X-Request-Id": "client-42", "Content-Type": "application/json"}
    async with without_keys.post("/v1/completions", data="{bad", headers=headers) as resp:
        assert resp.status == 400 and resp.headers["X-Request-Id"] == "client-42"
    async with without_keys.get("/v1/models", headers={"X-Request-Id": "client-43"}) as resp:
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "client-43"
    async with without_keys.get("/v1/models", headers={"X-Request-Id": "has space"}) as resp:
        assert "X-Request-Id" not in resp.headers  # (not a token: not echoed)


async def test_a_served_model_name_with_a_slash_has_its_models_route() -> None:
    config = GatewayConfig(
        mesh=MeshConfig(instance_id="gw-slash"), host="127.0.0.1",
        served_model_name="Qwen/Qwen2.5-0.5B-Instruct",
    )  # fmt: skip
    app = build_app(config, MeshClient(config))
    async with (
        TestClient(TestServer(app)) as client,
        client.get("/v1/models/Qwen/Qwen2.5-0.5B-Instruct") as resp,
    ):
        assert resp.status == 200 and (await resp.json())["id"] == config.served_model_name


async def test_a_body_that_stops_arriving_is_a_408(
    without_keys: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload that stalls held its connection and handler without any limit."""
    from services.gateway import app

    monkeypatch.setattr(app, "BODY_TIMEOUT_S", 0.3)
    server = without_keys.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"pro'
    )
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    assert b" 408 " in status_line


@pytest.mark.parametrize(
    "path", ["/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"]
)
async def test_embedding_and_score_routes_need_an_api_key(with_keys: Client, path: str):
    """They spend the mesh's executors as /v1 does, on any of vLLM's paths."""
    async with with_keys.post(path, json={"input": "x", "query": "q"}) as resp:
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "invalid_api_key"
