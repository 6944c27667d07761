"""``meshserve up --nats-cluster-size N`` and ``--regions a,b``: the local mesh on a NATS
cluster, or one whole mesh per region on a supercluster (``nats_cluster.py``).

Per region: a two-server cluster named after the region (JetStream runs clustered, the
region's KV-event stream at R2 on its own servers), joined to the other regions by gateways,
and every service started with ``--region NAME`` (its subjects, logs, metrics and traces say
where it runs; so does ``ps``). Region ``i``'s gateway listens on ``--port + i``. Its scheduler
knows the other regions (``--peer-regions``) and spills to them past ``--spill-queue-ms``
(with one executor per region it keeps none guest-free: ``--spill-reserve-executors 0``);
its gateway does not require a local executor (``--required-stages``): with none, the
scheduler sends everything to another region.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from services.launcher.mesh import LocalMesh
from services.launcher.nats_cluster import ClusterPlan, NatsCluster, Supercluster

REGION_SERVERS = 2  # per region: the fewest with which JetStream runs clustered


@dataclass
class RegionMesh(LocalMesh):
    """A ``LocalMesh`` on a given NATS cluster, with the region's flags on every service."""

    region: str = ""
    peers: tuple[str, ...] = ()
    kv_replicas: int = 1
    spill_queue_ms: float | None = None

    def spawn(self, name: str, module: str, *flags: str) -> None:
        extra: list[str] = []
        if self.region:
            extra += ["--region", self.region]
        if self.kv_replicas > 1:
            extra += ["--kv-replicas", str(self.kv_replicas)]
        if module == "services.scheduler" and self.peers:
            extra += ["--peer-regions", ",".join(self.peers)]
            if self.spill_queue_ms is not None:
                extra += ["--spill-queue-ms", str(self.spill_queue_ms)]
            if len(self.executor_roles) <= 1:
                # One executor: a guest-free executor in reserve (the default 1) would leave
                # none for guests, and the local demo would never take spilled work.
                extra += ["--spill-reserve-executors", "0"]
        if module == "services.gateway" and self.region:
            extra += ["--required-stages", "tokenizer,scheduler,detokenizer"]
        super().spawn(f"{self.region}-{name}" if self.region else name, module, *flags, *extra)


def region_names(text: str) -> tuple[str, ...]:
    names = tuple(r.strip() for r in text.split(",") if r.strip())
    if len(names) < 2 or len(set(names)) != len(names):
        raise ValueError("--regions needs two or more distinct names, e.g. us-east,eu-west")
    return names


def start_cluster(size: int) -> NatsCluster:
    """A started cluster whose JetStream answers; on any failure (or Ctrl-C) its servers are
    stopped first: they run in their own session, so nothing else would end them."""
    plan = replace(ClusterPlan.free("meshserve", size), end_with_starter=True)
    cluster = NatsCluster.start(plan)
    try:
        cluster.wait_jetstream()
    except BaseException as exc:
        cluster.stop()
        if isinstance(exc, Exception):
            raise RuntimeError(f"the NATS cluster did not come up: {exc!r}") from exc
        raise
    return cluster


def start_regions(
    args: argparse.Namespace, model_folder: Any, logs: Any = None
) -> tuple[Supercluster, list[RegionMesh]]:
    """The supercluster and one started mesh per region (not yet ready)."""
    regions = region_names(args.regions)
    supercluster = Supercluster.start(
        [
            replace(ClusterPlan.free(r, REGION_SERVERS, gateways=True), end_with_starter=True)
            for r in regions
        ]
    )
    meshes: list[RegionMesh] = []
    metrics_port = args.metrics_port  # each region's services take the next free ones
    try:
        supercluster.wait_jetstream()
        for i, region in enumerate(regions):
            region_args = argparse.Namespace(**vars(args))
            region_args.port = args.port + i
            region_args.nats_url = supercluster.clusters[region].url
            region_args.metrics_port = metrics_port
            mesh = RegionMesh(
                region_args,
                model_folder,
                logs=logs,
                region=region,
                peers=tuple(r for r in regions if r != region),
                kv_replicas=REGION_SERVERS,
                spill_queue_ms=args.spill_queue_ms,
            )
            mesh.executors_on_host = len(regions) * len(mesh.executor_roles)
            mesh.first_executor = len(meshes) * len(mesh.executor_roles)
            meshes.append(mesh)
            mesh.start()
            if metrics_port is not None:
                metrics_port += mesh.metrics_ports
    except Exception:
        for mesh in meshes:
            mesh.stop()
        supercluster.stop()
        raise
    return supercluster, meshes


def wait_all_ready(
    meshes: list[RegionMesh], timeout: float, watch: Callable[[], None] | None = None
) -> None:
    """Every region's gateway healthy; ``watch`` (the supervisors' poll: a service that dies
    while the models load is restarted, as ``up`` does without regions) runs meanwhile."""
    deadline = time.monotonic() + timeout
    for mesh in meshes:
        mesh.wait_ready(max(1.0, deadline - time.monotonic()), watch)


def run_regions(args: argparse.Namespace) -> int:
    """``meshserve up --regions``: start, report, supervise until Ctrl-C, stop."""
    import logging
    import signal
    import sys

    from gpu.cache_dir import cache_root
    from services.launcher.console import ServiceLogs
    from services.launcher.mesh import resolve_model
    from services.launcher.supervisor import DeferredInterrupt, RestartPolicy
    from services.launcher.up import kill_on_signal

    folder = resolve_model(args.model)
    log_dir = args.log_dir or cache_root() / "logs" / f"up-{args.port}"
    logs = ServiceLogs(log_dir, logging.getLevelNamesMapping()[args.log_level.upper()])
    interrupts = DeferredInterrupt()
    signal.signal(signal.SIGTERM, interrupts.handler)
    signal.signal(signal.SIGINT, interrupts.handler)
    supercluster: Supercluster | None = None
    meshes: list[RegionMesh] = []
    try:
        with interrupts.deferred():
            supercluster, meshes = start_regions(args, folder, logs)
        supervisors = [m.supervisor(RestartPolicy(), interrupts) for m in meshes]
        for mesh, sup in zip(meshes, supervisors, strict=True):
            supercluster.clusters[mesh.region].supervise(sup, f"{mesh.region}-nats-server")

        def watch() -> None:
            for sup in supervisors:
                sup.poll()
            logs.echo()

        wait_all_ready(meshes, args.ready_timeout, watch)
        for mesh in meshes:
            nats = supercluster.clusters[mesh.region].url
            print(f"region {mesh.region} is up: {mesh.base_url}/v1  (nats {nats})", flush=True)
        while True:
            watch()
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("stopping...", file=sys.stderr)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        logs.echo()
        print(f"meshserve up: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (first: nothing interrupts stopping)
        signal.signal(signal.SIGINT, kill_on_signal(list(meshes)))  # a second Ctrl-C
        for mesh in meshes:
            mesh.stop()
        if supercluster is not None:
            supercluster.stop()
        logs.echo()
