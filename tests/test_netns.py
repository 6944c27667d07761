"""tools/net/netns.py: a TCP connection across a link, stalled (not reset) while it is cut and
resumed on heal; the other link unaffected; nothing left behind."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from tools.net.netns import Namespace, ip, unavailable

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

# A server inside the namespace: accepts one connection and sends back what it receives.
ECHO = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
while data := conn.recv(100):
    conn.sendall(data)
"""


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    ns = Namespace.create(["a", "b"], tag="mst")
    try:
        yield ns
    finally:
        ns.remove()


def echo_server(ns: Namespace, address: str) -> tuple[subprocess.Popen[str], int]:
    cmd = [*ns.command_prefix, "python3", "-c", ECHO, address]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_a_cut_link_drops_packets_without_a_reset_and_heals(namespace: Namespace) -> None:
    a, b = namespace.links["a"], namespace.links["b"]
    proc, port = echo_server(namespace, a.ns_ip)
    try:
        conn = socket.create_connection((a.ns_ip, port), timeout=5)
        conn.sendall(b"before")
        assert conn.recv(100) == b"before"

        namespace.cut("a")
        conn.settimeout(1.0)
        conn.sendall(b"during")  # taken by the kernel; nothing arrives, nothing is reset
        with pytest.raises(TimeoutError):
            conn.recv(100)
        with pytest.raises(TimeoutError):  # a new connection's SYN is dropped too
            socket.create_connection((a.ns_ip, port), timeout=1.0)
        # The other link still carries traffic (its address, the same server's namespace).
        assert ip("route", "get", b.ns_ip).split()[2] == b.host_if
        assert ip("route", "get", a.ns_ip).split()[2] == a.host_if  # never the default route

        namespace.heal("a")
        conn.settimeout(10.0)  # TCP's next retransmission delivers what was held
        received = b""
        deadline = time.monotonic() + 10
        while received != b"during" and time.monotonic() < deadline:
            received += conn.recv(100)
        assert received == b"during"
        conn.close()
    finally:
        proc.kill()
        proc.wait()


def test_remove_leaves_nothing_behind() -> None:
    ns = Namespace.create(["a"], tag="mst")
    link = ns.links["a"]
    assert ns.name in ip("netns", "list")
    ns.remove()
    ns.remove()  # twice is harmless
    assert ns.name not in ip("netns", "list")
    assert link.host_if not in ip("-o", "link")
    assert str(link.subnet) not in ip("route")
