"""`meshserve up` as a user runs it: separate processes, ready message, Ctrl-C stops them all,
and a process that dies is restarted while the rest of the mesh keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

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


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except FileNotFoundError:
        return []


def resident_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def child_running(parent: int, *words: str) -> int | None:
    """The pid of the live child of ``parent`` whose command line holds every one of ``words``."""
    for pid in children_of(parent):
        if is_running(pid) and all(w in cmdline(pid) for w in words):
            return pid
    return None


class Up:
    """A ``meshserve up`` process in its own session: its console is ``stdout`` (read by the
    test) and ``up.log`` (its stderr); each service writes to ``logs/<name>.log``."""

    def __init__(self, model: Path, tmp_path: Path, *flags: str) -> None:
        self.port = free_port()
        self.log_path = tmp_path / "up.log"
        self.log_dir = tmp_path / "logs"
        self.log_file = self.log_path.open("w")
        self.console: list[str] = []  # stdout lines read so far
        cmd = [sys.executable, "-m", "services.launcher", "up", "--model", str(model)]
        cmd += ["--port", str(self.port), "--kv-cache-tokens", "1024"]
        cmd += ["--served-model-name", "tiny", "--log-dir", str(self.log_dir), *flags]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self.log_file,
            text=True,
            start_new_session=True,  # so the test can send Ctrl-C to the whole group
        )

    def log(self) -> str:
        """What ``up`` itself wrote to stderr (restarts, the services' warnings and errors)."""
        self.log_file.flush()
        return self.log_path.read_text(errors="replace")

    def service_log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def log_tail(self) -> str:
        tails = ["--- up (stderr):", *self.log().splitlines()[-40:]]
        for path in sorted(self.log_dir.glob("*.log")):
            tails += [f"--- {path.name}:", *self.service_log(path.stem).splitlines()[-15:]]
        return "\n".join(tails)

    def wait_up(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline and "is up" not in line:
            line = self.proc.stdout.readline() if self.proc.stdout else ""
            if line:
                self.console.append(line.rstrip("\n"))
            if self.proc.poll() is not None:
                pytest.fail(f"meshserve up exited with {self.proc.returncode}:\n{self.log_tail()}")
        return line

    def wait_log(self, text: str, count: int = 1, timeout: float = 10) -> None:
        """Until ``text`` is in up's own log ``count`` times."""
        deadline = time.monotonic() + timeout
        while self.log().count(text) < count:
            assert time.monotonic() < deadline, f"no {text!r} in the log:\n{self.log_tail()}"
            time.sleep(0.1)

    def chat(self, content: str, timeout: float = 30) -> tuple[int, str]:
        """One non-streaming chat completion: (HTTP status, the answer's text or the error)."""
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
            "ignore_eos": True,
            # The tiny model's vocabulary has reserved special tokens: four of them sampled in
            # a row were an empty answer to a request that was served.
            "skip_special_tokens": False,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.load(resp)["choices"][0]["message"]["content"]
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def ctrl_c_stops_everything(self) -> None:
        kids = children_of(self.proc.pid)
        os.killpg(self.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert self.proc.wait(60) == 0, self.log_tail()
        time.sleep(0.5)
        alive = [k for k in kids if is_running(k)]
        assert not alive, f"processes left behind: {alive}"


@contextlib.contextmanager
def meshserve_up(model: Path, tmp_path: Path, *flags: str) -> Iterator[Up]:
    up = Up(model, tmp_path, *flags)
    try:
        yield up
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
        up.log_file.close()


def test_up_serves_and_ctrl_c_stops_every_process(tiny_llama, tmp_path):
    with meshserve_up(tiny_llama, tmp_path, "--executors", "2") as up:
        line = up.wait_up()
        assert f"http://127.0.0.1:{up.port}/v1" in line
        # The launcher only starts processes: the runtime it starts is not in it (it held
        # ~226 MB when it imported torch; ~25 MB without).
        assert "libtorch" not in Path(f"/proc/{up.proc.pid}/maps").read_text()
        assert resident_mb(up.proc.pid) < 120, resident_mb(up.proc.pid)
        kids = children_of(up.proc.pid)
        assert (
            len(kids) >= 7
        )  # nats-server, tokenizer, scheduler, detokenizer, 2 executors, gateway
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="x")
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=5)
        assert out.choices[0].finish_reason in ("stop", "length")
        os.killpg(up.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        time.sleep(0.3)
        os.killpg(up.proc.pid, signal.SIGINT)  # an impatient second Ctrl-C
        assert up.proc.wait(60) == 0, up.log_tail()
        time.sleep(0.5)
        alive = [k for k in kids if is_running(k)]
        assert not alive, f"processes left behind: {alive}"
        # nats-server outlived the services' drains (it is stopped last, not by the Ctrl-C)
        for path in up.log_dir.glob("*.log"):
            assert "draining connection timed out" not in path.read_text(), up.log_tail()


def test_up_killed_with_sigkill_takes_every_process_with_it(tiny_llama, tmp_path):
    """``up`` cannot stop anything when SIGKILLed (or chosen by the OOM killer): its services
    and its nats-server (a session of its own) get SIGTERM from the kernel instead of going on
    holding the ports, so the next ``up`` can start."""
    with meshserve_up(tiny_llama, tmp_path) as up:
        up.wait_up()
        kids = children_of(up.proc.pid)
        names = {Path(cmdline(k)[0]).name for k in kids}
        assert len(kids) >= 6 and any("nats-server" in n for n in names), names
        up.proc.kill()  # only up itself, not its process group
        up.proc.wait(10)
        deadline = time.monotonic() + 45  # an executor drains for up to 30 s
        while (alive := [k for k in kids if is_running(k)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, [cmdline(k) for k in alive]


def test_up_console_says_what_a_user_needs_and_the_rest_goes_to_files(tiny_llama, tmp_path):
    """Before "is up": the model, where the logs are, each service once, the URL; no config
    dumps or access-log lines (those are in the services' files)."""
    with meshserve_up(tiny_llama, tmp_path) as up:
        line = up.wait_up()
        console = [*up.console, *up.log().splitlines()]
        assert len(console) < 25, "\n".join(console)
        assert f"http://127.0.0.1:{up.port}/v1" in line
        assert any(str(up.log_dir) in c for c in console), console
        names = ["tokenizer", "prefix-index", "scheduler", "detokenizer-0", "executor-0"]
        for name in [*names, "gateway"]:
            assert f"  {name} ready" in console, console
            assert up.service_log(name), f"{name} wrote nothing to {up.log_dir}"
        assert "executor config: ExecutorConfig(" in up.service_log("executor-0")
        assert not [c for c in console if "config:" in c or "GET /health" in c], console
        up.ctrl_c_stops_everything()


def test_up_restarts_a_killed_executor_while_the_other_serves(tiny_llama, tmp_path):
    with meshserve_up(tiny_llama, tmp_path, "--executors", "2") as up:
        up.wait_up()
        executor_0 = ("services.executor", "--instance-id", "executor-0")
        old = child_running(up.proc.pid, *executor_0)
        assert old is not None, up.log_tail()
        status, text = up.chat("warm up")
        assert status == 200 and text, (status, text, up.log_tail())
        os.kill(old, signal.SIGKILL)
        while is_running(old):
            time.sleep(0.01)
        answered_while_down = 0
        deadline = time.monotonic() + 40
        while (new := child_running(up.proc.pid, *executor_0)) is None:
            assert time.monotonic() < deadline, f"executor-0 not restarted:\n{up.log_tail()}"
            status, text = up.chat(f"question {answered_while_down}")
            assert status == 200 and text, (status, text, up.log_tail())
            # counted only if no replacement existed when the answer came: executor-1 gave it
            answered_while_down += child_running(up.proc.pid, *executor_0) is None
        assert answered_while_down >= 1, up.log_tail()
        assert new != old
        up.wait_log(
            f"meshserve up: executor-0 (pid {old}) died (killed by SIGKILL); restarting it in"
        )
        up.wait_log(f"meshserve up: executor-0 restarted (pid {new})")
        joined = "executor executor-0 connected to nats"
        while up.service_log("executor-0").count(joined) < 2:  # until it joined, the other serves
            assert time.monotonic() < deadline, f"executor-0 never joined:\n{up.log_tail()}"
            status, text = up.chat("while it starts")
            assert status == 200 and text, (status, text, up.log_tail())
        status, text = up.chat("after the restart")
        assert status == 200 and text, (status, text, up.log_tail())
        assert is_running(new), up.log_tail()  # the replacement did not die at start
        up.ctrl_c_stops_everything()  # the replacement included


def test_up_restarts_an_executor_whose_tensor_parallel_rank_died(tiny_llama, tmp_path):
    """Kill -9 the second rank of executor-0 (TP=2): the idle executor notices by itself (its
    heartbeat checks the ranks; no request has to fail on the group first) and exits 3, not a
    hang; executor-1 answers meanwhile, and up restarts executor-0 with a new rank."""
    flags = ("--executors", "2", "--tensor-parallel-size", "2")
    with meshserve_up(tiny_llama, tmp_path, *flags) as up:
        up.wait_up()
        executor_0 = ("services.executor", "--instance-id", "executor-0")
        old = child_running(up.proc.pid, *executor_0)
        assert old is not None, up.log_tail()
        rank = child_running(old, "gpu.parallel.worker")
        assert rank is not None, up.log_tail()
        status, text = up.chat("warm up")
        assert status == 200 and text, (status, text, up.log_tail())
        os.kill(rank, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (new := child_running(up.proc.pid, *executor_0)) in (None, old):
            assert time.monotonic() < deadline, f"executor-0 not restarted:\n{up.log_tail()}"
            time.sleep(0.1)  # no request: the idle executor must find the dead rank itself
        status, text = up.chat("while it is down")
        assert status == 200 and text, (status, text, up.log_tail())
        up.wait_log(f"meshserve up: executor-0 (pid {old}) died (exit code 3); restarting it in")
        assert "tensor-parallel group lost" in up.service_log("executor-0")
        joined = "executor executor-0 connected to nats"
        while up.service_log("executor-0").count(joined) < 2:  # the new one, ranks and all
            assert time.monotonic() < deadline, f"executor-0 never rejoined:\n{up.log_tail()}"
            time.sleep(0.1)
        assert child_running(new, "gpu.parallel.worker") is not None, up.log_tail()
        status, text = up.chat("after the restart")
        assert status == 200 and text, (status, text, up.log_tail())
        up.ctrl_c_stops_everything()


def test_up_restarts_nats_server_on_the_same_port(tiny_llama, tmp_path):
    with meshserve_up(tiny_llama, tmp_path) as up:
        up.wait_up()
        nats = next(p for p in children_of(up.proc.pid) if "-js" in cmdline(p))
        args = cmdline(nats)
        port = args[args.index("-p") + 1]
        os.kill(nats, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (new := child_running(up.proc.pid, "-p", port)) in (None, nats):
            assert time.monotonic() < deadline, f"nats-server not restarted:\n{up.log_tail()}"
            time.sleep(0.1)
        up.wait_log(f"meshserve up: nats-server (pid {nats}) died (killed by SIGKILL)")
        up.wait_log(f"meshserve up: nats-server restarted (pid {new})")
        while (answer := up.chat("after nats", timeout=10))[0] != 200:  # services reconnect
            assert time.monotonic() < deadline, (answer, up.log_tail())
            time.sleep(0.5)
        assert answer[1], (answer, up.log_tail())  # an empty text: the log says where it went
        up.ctrl_c_stops_everything()


async def routed_between(url_a: str, url_b: str) -> bytes:
    """A message published at ``url_b`` as a subscriber at ``url_a`` receives it (the two
    servers are routed to each other), and JetStream answering at ``url_b``."""
    import nats

    from services.launcher.nats_cluster import jetstream_ready

    a, b = await nats.connect(url_a), await nats.connect(url_b)
    try:
        sub = await a.subscribe("test.routed")
        await a.flush()
        deadline = time.monotonic() + 20
        while True:  # the subscription reaches the other server over the route
            await b.publish("test.routed", b"across")
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                msg = await sub.next_msg(timeout=0.5)
                await jetstream_ready(url_b, timeout=30)
                return msg.data
            assert time.monotonic() < deadline, "the restarted server is not routed"
    finally:
        await a.close()
        await b.close()


def test_up_restarts_a_dead_server_of_its_nats_cluster(tiny_llama, tmp_path):
    """A cluster of three keeps JetStream's quorum only while two live: up restarts a killed
    one on its ports and it rejoins (routes, JetStream), where it stayed dead and a second
    death would have cost the quorum."""
    with meshserve_up(tiny_llama, tmp_path, "--nats-cluster-size", "3") as up:
        up.wait_up()
        servers = sorted(p for p in children_of(up.proc.pid) if "-js" in cmdline(p))
        assert len(servers) == 3, [cmdline(p) for p in servers]
        ports = [cmdline(p)[cmdline(p).index("-p") + 1] for p in servers]
        os.kill(servers[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (new := child_running(up.proc.pid, "-p", ports[0])) in (None, servers[0]):
            assert time.monotonic() < deadline, f"nats-server not restarted:\n{up.log_tail()}"
            time.sleep(0.1)
        up.wait_log(f"nats-server-0 (pid {servers[0]}) died (killed by SIGKILL)")
        up.wait_log(f"nats-server-0 restarted (pid {new})")
        url = "nats://127.0.0.1:{}".format
        assert asyncio.run(routed_between(url(ports[1]), url(ports[0]))) == b"across"
        while (answer := up.chat("after a server", timeout=10))[0] != 200:
            assert time.monotonic() < deadline + 20, (answer, up.log_tail())
            time.sleep(0.5)
        up.ctrl_c_stops_everything()


def test_up_gives_up_on_a_service_that_dies_at_every_start(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHSERVE_INDEX_EXECUTOR_TIMEOUT", "not-a-number")  # prefix-index only
    with meshserve_up(tiny_llama, tmp_path) as up:
        seen: set[int] = set()
        deadline = time.monotonic() + 60
        while up.proc.poll() is None:
            assert time.monotonic() < deadline, up.log_tail()
            seen.update(children_of(up.proc.pid))
            time.sleep(0.1)
        assert up.proc.returncode == 1, up.log_tail()
        lines = [s for s in up.log().splitlines() if s.startswith("meshserve up: prefix-index")]
        restarts = [s for s in lines if "died (exit code 2); restarting it in" in s]  # bad flag
        assert [s.rsplit(" in ", 1)[1] for s in restarts] == ["0.5 s", "1.0 s", "2.0 s", "4.0 s"]
        assert lines[-1].endswith("it crashed 5 times within 60 s, giving up on it"), lines
        time.sleep(0.5)
        alive = [k for k in seen if is_running(k)]
        assert not alive, f"processes left behind: {alive}"


def test_the_launcher_imports_no_runtime():
    """Building the whole ``meshserve`` command line (``up`` included) imports neither torch,
    transformers nor numpy: ``meshserve up`` runs them only in the processes it starts."""
    code = (
        "import sys\n"
        "from services.launcher import cli\n"
        "try:\n"
        "    cli.main(['up', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted({'torch', 'transformers', 'numpy'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--quantization" in out.stdout  # the runtime's choices are there all the same
