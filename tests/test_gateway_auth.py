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
