"""NATS clusters and superclusters on loopback, for ``meshserve up --nats-cluster-size`` and
``--regions`` (and the tests): nats-server processes joined by routes (one cluster) and by
gateways (one cluster per region), with JetStream clustered.

- A cluster of N servers: every server lists every other's route port; JetStream needs a
  ``server_name`` per server and the cluster's name, and then replicates streams (the
  KV-event stream at ``--kv-replicas``, 3 on three servers: one server lost loses nothing).
- A supercluster: per region a cluster named after the region, each server tagged
  ``region:<name>`` (``common/kv_stream.py`` places the region's stream by that tag), and a
  ``gateway`` block listing the other regions' gateway URLs. ``gateway_urls`` lets the caller
  put something between regions (a delaying or cuttable TCP proxy, ``tools/net/tcp_proxy.py``):
  what a region dials to reach another and what it advertises as its own address.
- A cluster may listen for clients and gateways on another address than loopback, and run
  its servers through a command prefix: ``tests/test_partition.py`` puts a region in a network
  namespace (``ip netns exec``) whose links to the host can be cut. Routes stay on 127.0.0.1,
  the loopback of wherever the cluster's servers run.
- Users and permissions are per server: ``authorization`` (an ``authorization`` block, per
  region that of ``common.nats_permissions.region_config``) goes into each server's config,
  and the JetStream readiness check then logs in with ``connect_options`` (a user allowed
  ``$JS.API.STREAM.NAMES``, such as the prefix index).

deploy/nats/ holds the same shape as config files for real hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.nats_server import LocalNatsServer, free_port

if TYPE_CHECKING:
    from services.launcher.supervisor import Supervisor

JETSTREAM_READY_S = 30.0  # a clustered JetStream elects its meta leader first


@dataclass(frozen=True)
class ClusterPlan:
    """The ports of one cluster's servers, chosen before any starts (each lists the others)."""

    name: str
    client_ports: tuple[int, ...]
    route_ports: tuple[int, ...]
    gateway_ports: tuple[int, ...] = ()
    host: str = "127.0.0.1"  # where clients connect
    gateway_host: str = "127.0.0.1"  # where other regions' gateways connect
    command_prefix: tuple[str, ...] = ()  # runs each server, e.g. ("ip", "netns", "exec", NS)
    end_with_starter: bool = False  # servers get SIGTERM if their starter dies (meshserve up)

    @classmethod
    def free(
        cls,
        name: str,
        size: int,
        gateways: bool = False,
        host: str = "127.0.0.1",
        gateway_host: str = "127.0.0.1",
        command_prefix: tuple[str, ...] = (),
    ) -> ClusterPlan:
        """Ports free on this machine's loopback (in a namespace of its own, any is free)."""
        if size < 1:
            raise ValueError("a cluster needs at least one server")
        ports = [free_port() for _ in range(size * (3 if gateways else 2))]
        while len(set(ports)) < len(ports):  # two draws may return the same free port
            ports = [free_port() for _ in ports]
        clients, routes = tuple(ports[:size]), tuple(ports[size : 2 * size])
        gateway_ports = tuple(ports[2 * size :]) if gateways else ()
        return cls(name, clients, routes, gateway_ports, host, gateway_host, command_prefix)

    @property
    def urls(self) -> list[str]:
        return [f"nats://{self.host}:{p}" for p in self.client_ports]

    @property
    def gateway_addresses(self) -> list[str]:
        return [f"{self.gateway_host}:{p}" for p in self.gateway_ports]


def server_config(
    plan: ClusterPlan,
    index: int,
    remote_gateways: Mapping[str, list[str]] | None = None,
    advertise: str | None = None,
    authorization: str = "",
) -> str:
    """The config file of server ``index`` of ``plan`` (client port and JetStream store come
    from the command line, ``LocalNatsServer.start``); ``authorization``: its users."""
    name = f"{plan.name}-{index}"
    routes = ", ".join(
        f'"nats://127.0.0.1:{p}"' for i, p in enumerate(plan.route_ports) if i != index
    )
    lines = [
        f'server_name: "{name}"',
        f'server_tags: ["region:{plan.name}"]',
        "cluster {",
        f'  name: "{plan.name}"',
        f'  listen: "127.0.0.1:{plan.route_ports[index]}"',
        f"  routes: [{routes}]",
        "  connect_retries: 30",
        "}",
    ]
    if plan.gateway_ports:
        remotes = ", ".join(
            f'{{name: "{region}", urls: [{quoted_urls(urls)}]}}'
            for region, urls in (remote_gateways or {}).items()
        )
        lines += [
            "gateway {",
            f'  name: "{plan.name}"',
            f'  listen: "{plan.gateway_addresses[index]}"',
            *([f'  advertise: "{advertise}"'] if advertise else []),
            "  connect_retries: 1000000",
            f"  gateways: [{remotes}]",
            "}",
        ]
    return "\n".join(lines) + "\n" + authorization


def quoted_urls(addresses: list[str]) -> str:
    return ", ".join(f'"nats://{address}"' for address in addresses)


@dataclass
class NatsCluster:
    """The running servers of one cluster; ``kill`` one to test failover, ``restart`` it (or
    ``supervise`` them all), ``stop`` them all."""

    plan: ClusterPlan
    servers: list[LocalNatsServer | None] = field(default_factory=list)
    remote_gateways: Mapping[str, list[str]] | None = None
    advertise: list[str] | None = None
    authorization: str = ""

    @classmethod
    def start(
        cls,
        plan: ClusterPlan,
        remote_gateways: Mapping[str, list[str]] | None = None,
        advertise: list[str] | None = None,
        authorization: str = "",
    ) -> NatsCluster:
        cluster = cls(plan, [], remote_gateways, advertise, authorization)
        try:
            for i in range(len(plan.client_ports)):
                cluster.servers.append(cluster.start_server(i))
        except Exception:
            cluster.stop()
            raise
        return cluster

    def start_server(self, index: int) -> LocalNatsServer:
        plan = self.plan
        advertise = self.advertise[index] if self.advertise else None
        return LocalNatsServer.start(
            port=plan.client_ports[index],
            config=server_config(plan, index, self.remote_gateways, advertise, self.authorization),
            host=plan.host,
            command_prefix=plan.command_prefix,
            end_with_starter=plan.end_with_starter,
        )

    def restart(self, index: int) -> subprocess.Popen[bytes]:
        """Server ``index`` again, dead or not, on its ports and under its name: it rejoins the
        cluster by its routes (and the supercluster by its gateway), and JetStream catches its
        replicas up from the other servers (its store starts empty)."""
        old, self.servers[index] = self.servers[index], None
        if old is not None:
            old.stop()  # (this also removes its store folder)
        server = self.start_server(index)
        self.servers[index] = server
        return server.process

    def supervise(self, supervisor: Supervisor, label: str = "nats-server") -> None:
        """Have ``supervisor`` restart any server of this cluster that dies (``label-i``): a
        cluster of three keeps its JetStream quorum only while two live, so each death must
        be repaired, not just survived."""
        for i, server in enumerate(self.servers):
            if server is not None:
                restart = functools.partial(self.restart, i)
                supervisor.watch(f"{label}-{i}", server.process, restart)

    @property
    def url(self) -> str:
        """Every server's URL, comma-separated (what ``--nats-url`` takes)."""
        return ",".join(self.plan.urls)

    def kill(self, index: int) -> None:
        """SIGKILL server ``index``: no goodbye to its clients or its routes."""
        server = self.servers[index]
        assert server is not None
        server.process.kill()
        server.process.wait()

    def stop(self) -> None:
        for server in self.servers:
            if server is not None:
                server.stop()

    def wait_jetstream(
        self,
        timeout: float = JETSTREAM_READY_S,
        connect_options: Mapping[str, Any] | None = None,
    ) -> None:
        """Until the cluster's JetStream answers (its meta leader is elected)."""
        asyncio.run(jetstream_ready(self.url, timeout, connect_options))


async def jetstream_ready(
    url: str,
    timeout: float = JETSTREAM_READY_S,
    connect_options: Mapping[str, Any] | None = None,
) -> None:
    """Until JetStream answers ``STREAM.NAMES`` (an API the prefix index's user may call)."""
    import nats

    deadline = time.monotonic() + timeout
    options = dict(connect_options or {})
    nc = await nats.connect(servers=url.split(","), connect_timeout=2, **options)
    try:
        while True:
            with contextlib.suppress(Exception):
                reply = await nc.request("$JS.API.STREAM.NAMES", b"{}", timeout=2)
                if b'"error"' not in reply.data:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"JetStream at {url} not ready within {timeout:.0f} s")
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


@dataclass
class Supercluster:
    """One cluster per region, joined by gateways."""

    clusters: dict[str, NatsCluster]

    @classmethod
    def start(
        cls,
        plans: list[ClusterPlan],
        gateway_urls: Mapping[str, list[str]] | None = None,
        authorization: Mapping[str, str] | None = None,
    ) -> Supercluster:
        """``gateway_urls``: per region, the addresses (host:port, one per server) other
        regions dial to reach it; default: its servers' gateway ports themselves.
        ``authorization``: per region, its servers' users (default: none, anyone may connect)."""
        dial = {p.name: list((gateway_urls or {}).get(p.name, p.gateway_addresses)) for p in plans}
        started: dict[str, NatsCluster] = {}
        try:
            for plan in plans:
                remotes = {name: urls for name, urls in dial.items() if name != plan.name}
                advertise = dial[plan.name] if gateway_urls else None
                users = (authorization or {}).get(plan.name, "")
                started[plan.name] = NatsCluster.start(plan, remotes, advertise, users)
        except Exception:
            for cluster in started.values():
                cluster.stop()
            raise
        return cls(started)

    def wait_jetstream(
        self,
        timeout: float = JETSTREAM_READY_S,
        connect_options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """``connect_options``: per region, how to log in there (with ``authorization``)."""
        for name, cluster in self.clusters.items():
            cluster.wait_jetstream(timeout, (connect_options or {}).get(name))

    def stop(self) -> None:
        for cluster in self.clusters.values():
            cluster.stop()
