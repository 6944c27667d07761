"""Chaos under load, through `meshserve up` as a user runs it: while streaming clients keep
coming, kill -9 an executor, the nats-server, the tokenizer, the detokenizer and the scheduler
in turn (the supervisor restarts each). Every request ends with its complete text or a clear
OpenAI error, none hangs, and afterwards nothing is left behind: every executor idle with its
pages free, the detokenizer holding no stream, the scheduler no request."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter

import aiohttp
import pytest

from common.nats_server import free_port_range
from tests.mesh import metric_value
from tests.test_up import Up, child_running, children_of, cmdline, is_running

CLIENTS = 6  # streams at once; a request that fails at once is followed by the next
HUNG_S = 60.0  # the watchdog fails a lost request within ~15 s; 60 s means it hung


async def stream(session: aiohttp.ClientSession, url: str, rng: random.Random) -> str:
    """One streamed completion: "ok", "error:<code>" (an OpenAI error), or what went wrong."""
    body = {
        "model": "tiny",
        "prompt": " ".join(rng.choice(["mesh", "page", "token"]) for _ in range(8)),
        "max_tokens": rng.randrange(20, 60),
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with asyncio.timeout(HUNG_S):
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    error = json.loads(await resp.read())["error"]
                    assert error["message"] and error["type"], error
                    return f"error:{error['code']}"
                finished = False
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        return "ok" if finished else "no finish_reason"
                    chunk = json.loads(data)
                    if "error" in chunk:
                        assert chunk["error"]["message"] and chunk["error"]["type"], chunk
                        return f"error:{chunk['error']['code']}"
                    finished = finished or chunk["choices"][0]["finish_reason"] is not None
                return "truncated"
    except TimeoutError:
        return "hung"
    except aiohttp.ClientError as exc:
        return f"transport: {type(exc).__name__}"


@pytest.mark.timeout(400)
async def test_every_request_ends_and_nothing_is_left_behind(tiny_llama, tmp_path):
    metrics = free_port_range(16)
    up = Up(tiny_llama, tmp_path, "--executors", "2", "--metrics-port", str(metrics))
    up.wait_up()
    url = f"http://127.0.0.1:{up.port}/v1/completions"
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()

    async def client(seed: int, session: aiohttp.ClientSession) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            outcomes[await stream(session, url, rng)] += 1

    def kill(*words: str) -> None:
        pid = child_running(up.proc.pid, *words)
        if pid is None and words == ("nats-server",):  # argv[0] is the binary's whole path
            pid = next(
                p
                for p in children_of(up.proc.pid)
                if is_running(p) and cmdline(p)[0].endswith("nats-server")
            )
        assert pid is not None, f"no live {words} under meshserve up:\n{up.log_tail()}"
        os.kill(pid, signal.SIGKILL)

    try:
        async with aiohttp.ClientSession() as session:
            clients = [asyncio.create_task(client(i, session)) for i in range(CLIENTS)]
            await asyncio.sleep(3)
            for victim in (
                ("services.executor", "executor-0"),
                ("nats-server",),
                ("services.tokenizer",),
                ("services.detokenizer",),
                ("services.scheduler",),
            ):
                kill(*victim)
                await asyncio.sleep(6)
            await asyncio.sleep(4)
            stop.set()
            await asyncio.gather(*clients)
        # The only errors: the bus was down (the gateway's own connection), a request lost in
        # a killed tokenizer or scheduler, a stream whose detokenizer died, or a request that
        # came while a stage had no live member. The executor's loss is invisible (migration).
        clear = {"mesh_unavailable", "request_lost", "stream_lost", "stage_unavailable"}
        bad = {k: n for k, n in outcomes.items() if k != "ok" and k[6:] not in clear}
        assert not bad, outcomes
        assert outcomes["ok"] > 20, outcomes
        for name in ("executor-0 (pid", "nats-server (pid", "tokenizer (pid", "scheduler (pid"):
            assert name in up.log(), up.log_tail()

        # Serving again, and nothing held anywhere.
        deadline = time.monotonic() + 60
        while up.chat("after the storm")[0] != 200:
            assert time.monotonic() < deadline, up.log_tail()
            time.sleep(0.5)
        # Metrics ports follow the spawn order: tokenizer, prefix-index, scheduler,
        # detokenizer-0, executor-0, executor-1.
        port = {"scheduler": metrics + 2, "detokenizer": metrics + 3}
        port |= {f"executor-{i}": metrics + 4 + i for i in range(2)}
        held = {
            ("scheduler", "meshserve:scheduler_queue_size"),
            ("scheduler", "meshserve:scheduler_inflight_requests"),
            ("detokenizer", "meshserve:detokenizer_streams"),
            *((f"executor-{i}", "meshserve:num_requests_running") for i in range(2)),
            *((f"executor-{i}", "meshserve:num_requests_waiting") for i in range(2)),
            *((f"executor-{i}", "meshserve:kv_cache_usage_perc") for i in range(2)),
        }
        deadline = time.monotonic() + 15
        while True:
            values = {
                (svc, name): metric_value(f"http://127.0.0.1:{port[svc]}/metrics", name)
                for svc, name in held
            }
            if not any(values.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not any(values.values()), {k: v for k, v in values.items() if v}
    finally:
        up.ctrl_c_stops_everything()
