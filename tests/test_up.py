"""`meshserve up` as a user runs it: separate processes, ready message, Ctrl-C stops them all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from common.nats_server import free_port


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_up_serves_and_ctrl_c_stops_every_process(tiny_llama, tmp_path):
    port = free_port()
    log_path = tmp_path / "up.log"  # every process's stderr, shown when an assertion fails
    log_file = log_path.open("w")

    def log_tail() -> str:
        log_file.flush()
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--model",
            str(tiny_llama),
            "--port",
            str(port),
            "--executors",
            "2",
            "--kv-cache-tokens",
            "1024",
            "--served-model-name",
            "tiny",
        ],
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
        start_new_session=True,  # so the test can send Ctrl-C to the whole group
    )
    try:
        deadline = time.monotonic() + 180
        line = ""
        while time.monotonic() < deadline and "is up" not in line:
            line = proc.stdout.readline() if proc.stdout else ""
            if proc.poll() is not None:
                pytest.fail(f"meshserve up exited with {proc.returncode}:\n{log_tail()}")
        assert f"http://127.0.0.1:{port}/v1" in line
        kids = children_of(proc.pid)
        assert (
            len(kids) >= 7
        )  # nats-server, tokenizer, scheduler, detokenizer, 2 executors, gateway
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=5)
        assert out.choices[0].finish_reason in ("stop", "length")
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)  # an impatient second Ctrl-C
        assert proc.wait(60) == 0, log_tail()
        time.sleep(0.5)
        alive = [k for k in kids if is_running(k)]
        assert not alive, f"processes left behind: {alive}"
        # nats-server outlived the services' drains (it is stopped last, not by the Ctrl-C)
        assert "draining connection timed out" not in log_tail(), log_tail()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log_file.close()
