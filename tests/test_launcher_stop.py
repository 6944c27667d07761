"""``meshserve up`` stops its services in stages, so requests in flight finish: the gateway
first, then the executors, then the rest; a second Ctrl-C kills them all."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from services.launcher.mesh import LocalMesh
from services.launcher.up import kill_on_signal, parse_up_args

MODULES = {
    "tokenizer": "services.tokenizer",
    "detokenizer-0": "services.detokenizer",
    "gateway": "services.gateway",
    "executor-0": "services.executor",
    "speculator": "services.speculator",
    "scheduler": "services.scheduler",
}


class FakeProcess:
    """Exits on SIGTERM once every process of the stage before it has exited (it still
    works, and needs them, until then)."""

    def __init__(self, name: str, events: list[str], needs: list[FakeProcess]) -> None:
        self.name, self.events, self.needs = name, events, needs
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        assert sig == signal.SIGTERM
        assert all(p.returncode is None for p in self.needs), f"{self.name} stopped too late"
        self.events.append(f"term {self.name}")
        self.returncode = 0

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.name, timeout or 0)
        return self.returncode

    def kill(self) -> None:
        self.events.append(f"kill {self.name}")
        self.returncode = -9


def mesh_of(tmp_path: Path, events: list[str]) -> LocalMesh:
    mesh = LocalMesh(parse_up_args(["--nats-url", "nats://127.0.0.1:1"]), tmp_path)
    procs: dict[str, FakeProcess] = {}
    for name, module in MODULES.items():
        mesh.commands[name] = [sys.executable, "-m", module]
        procs[name] = FakeProcess(name, events, [])
    # Everything the gateway's streams still need is running when it gets its SIGTERM.
    procs["gateway"].needs = [p for n, p in procs.items() if n != "gateway"]
    procs["executor-0"].needs = [procs[n] for n in ("tokenizer", "detokenizer-0", "scheduler")]
    mesh.procs = list(procs.items())  # type: ignore[arg-type]
    return mesh


def test_the_gateway_stops_first_then_the_executors_then_the_rest(tmp_path: Path) -> None:
    events: list[str] = []
    mesh_of(tmp_path, events).stop()
    assert events[0] == "term gateway"
    assert set(events[1:3]) == {"term executor-0", "term speculator"}
    assert set(events[3:]) == {"term tokenizer", "term detokenizer-0", "term scheduler"}


def test_a_second_ctrl_c_kills_every_service(tmp_path: Path) -> None:
    events: list[str] = []
    mesh = mesh_of(tmp_path, events)
    mesh.procs[0][1].returncode = 0  # (the tokenizer had exited already)
    kill_on_signal([mesh])(signal.SIGINT, None)
    assert sorted(events) == sorted(f"kill {n}" for n in MODULES if n != "tokenizer")
