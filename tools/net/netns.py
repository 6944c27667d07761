"""A network namespace joined to the host by veth pairs, each of which can be cut: a real
partition for tests (``tests/test_partition.py``), where ``tcp_proxy.DelayProxy`` can only
reset connections.

Each link is one veth pair with a /30 of 10.213.0.0/16: the host end ``.1``, the namespace end
``.2``. The namespace has no default route, so its processes reach only its own loopback and
the host ends of its links. ``cut(link)`` sets the namespace's end down: the host's end loses
its carrier, so whatever either side sends across is dropped without a word (no RST; a SYN from
the host times out; the namespace has no route left) and TCP connections open across it stall
and resume on ``heal``. The host's end stays up on purpose: setting it down removes its
connected route and the host would send that traffic to its default gateway; a blackhole route
for each /30 (the highest metric, so the connected route wins while it exists) keeps it on the
machine whatever happens to the link.

Needs root and ``ip`` (iproute2). Names carry the pid: tests running at once do not collide.
``remove()`` undoes everything and is registered with ``atexit`` in case the caller's
``finally`` never runs.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

POOL = ipaddress.IPv4Network("10.213.0.0/16")
BACKUP_METRIC = 4294967295  # the lowest priority a route can have: only a fallback
SERIAL = itertools.count()  # namespaces made by this process so far


def ip(*args: str, namespace: str = "") -> str:
    """Run ``ip ARGS`` (in ``namespace`` if given); its stdout, or CalledProcessError with
    ip's own message."""
    cmd = ["ip", *(["netns", "exec", namespace, "ip"] if namespace else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
    return done.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a test's skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        ip("netns", "list")
    except FileNotFoundError:
        return "no `ip` command (iproute2)"
    except subprocess.CalledProcessError as e:
        return f"`ip netns` fails: {e.stderr.strip()}"
    return None


def free_subnets(count: int) -> list[ipaddress.IPv4Network]:
    """``count`` /30s of POOL that no address on the host is in, starting at a place the pid
    picks (two processes choosing at once would rarely look at the same ones)."""
    used = [
        ipaddress.IPv4Interface(word).network
        for line in ip("-4", "-o", "addr").splitlines()
        for word in line.split()[3:4]
    ]
    subnets = list(POOL.subnets(new_prefix=30))
    start = (os.getpid() * 8) % len(subnets)
    found: list[ipaddress.IPv4Network] = []
    for subnet in subnets[start:] + subnets[:start]:
        if not any(subnet.overlaps(u) for u in used):
            found.append(subnet)
            if len(found) == count:
                return found
    raise RuntimeError(f"no {count} free /30 subnets in {POOL}")


@dataclass(frozen=True)
class Link:
    """One veth pair: ``host_if`` (address ``host_ip``) on the host, ``ns_if`` (``ns_ip``)
    in the namespace."""

    name: str
    host_if: str
    ns_if: str
    subnet: ipaddress.IPv4Network

    @property
    def host_ip(self) -> str:
        return str(self.subnet.network_address + 1)

    @property
    def ns_ip(self) -> str:
        return str(self.subnet.network_address + 2)


@dataclass
class Namespace:
    name: str
    links: dict[str, Link] = field(default_factory=dict)
    removed: bool = False

    @classmethod
    def create(cls, links: Sequence[str], tag: str = "ms") -> Namespace:
        """A namespace named ``<tag>-<pid>-<n>`` with its loopback up and one link per name
        in ``links``; everything made so far is removed if a step fails."""
        pid, n = os.getpid(), next(SERIAL)
        namespace = cls(f"{tag}-{pid}-{n}")
        atexit.register(namespace.remove)
        try:
            ip("netns", "add", namespace.name)
            ip("link", "set", "lo", "up", namespace=namespace.name)
            for i, (name, subnet) in enumerate(zip(links, free_subnets(len(links)), strict=True)):
                # Interface names have at most 15 characters.
                stem = f"{tag}{pid}.{n}"
                link = Link(name, f"{stem}h{i}"[:15], f"{stem}n{i}"[:15], subnet)
                namespace._add(link)
        except BaseException:
            namespace.remove()
            raise
        return namespace

    def _add(self, link: Link) -> None:
        prefix = link.subnet.prefixlen
        ip("link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if)
        self.links[link.name] = link  # from here remove() deletes it
        ip("route", "add", "blackhole", str(link.subnet), "metric", str(BACKUP_METRIC))
        ip("link", "set", link.ns_if, "netns", self.name)
        ip("addr", "add", f"{link.host_ip}/{prefix}", "dev", link.host_if)
        ip("link", "set", link.host_if, "up")
        ip("addr", "add", f"{link.ns_ip}/{prefix}", "dev", link.ns_if, namespace=self.name)
        ip("link", "set", link.ns_if, "up", namespace=self.name)

    @property
    def command_prefix(self) -> tuple[str, ...]:
        """Put before a command to run it inside the namespace (``ip netns exec`` execs it,
        so the process started is the command itself: signals reach it)."""
        return ("ip", "netns", "exec", self.name)

    def cut(self, link: str) -> None:
        ip("link", "set", self.links[link].ns_if, "down", namespace=self.name)

    def heal(self, link: str) -> None:
        ip("link", "set", self.links[link].ns_if, "up", namespace=self.name)

    def remove(self) -> None:
        """Delete the links, their fallback routes and the namespace (processes still inside
        keep it alive until they exit: stop them first). Safe to call twice."""
        if self.removed:
            return
        self.removed = True
        for link in self.links.values():
            # Deleting either end of a veth pair deletes both.
            for args in (
                ("link", "del", link.host_if),
                ("route", "del", "blackhole", str(link.subnet), "metric", str(BACKUP_METRIC)),
            ):
                subprocess.run(["ip", *args], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
