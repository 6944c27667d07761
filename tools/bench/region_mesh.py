"""One region's whole mesh in a process of its own, driven over stdin by ``tools.bench.regions``.

    python -m tools.bench.region_mesh --model DIR --nats-url URLS --region eu-west \\
        --peer-regions us-east [--spill-queue-ms 300] [--max-num-seqs 4] [--step-ms 15] \\
        [--prefill-ms-per-token 0] [--executors 1] [--spill-reserve-executors 0]

Two regions are two sets of machines: run in one interpreter, one region's Python work (and
the load generator's) would take the GIL from the other's, and a local request in the quiet
region would pay for the overloaded one's traffic. So each region's mesh (the tests' harness,
``tests/mesh.py``, its executors slowed to ``--step-ms`` per step and ``--prefill-ms-per-token``
per prompt token, ``paced.py``) lives in its own child.

Protocol, one JSON object per line: once the mesh serves, the child writes
``{"base_url": ...}``; then for each command read on stdin it writes one reply:

- ``spill on`` / ``spill off``: give the scheduler its peer regions, or none -> ``{}``;
- ``spilled``: requests this region's scheduler sent elsewhere so far -> ``{"spilled": n}``;
- ``rtt``: the round trip to the peers its scheduler measured -> ``{"rtt_ms": x}``;
- ``local``: for each request of this region's own clients finished since the last ``local``,
  in ms: the gateway's arrival -> its executor's receipt, -> the start of the step that
  scheduled it, -> its first token, and its TTFT as the gateway measured it ->
  ``{"to_executor_ms": [...], "queue_ms": [...], "first_step_ms": [...],
  "gateway_ttft_ms": [...]}`` (where the time a local client waits goes, with guests and
  without);
- ``preemptions``: guests this region's executors preempted for its own clients' requests
  so far -> ``{"guests_yielded": n}``;
- ``stop`` (or end of input): the mesh stops and the child exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path

from services.detokenizer.service import DetokenizerService
from services.gateway.app import GatewayServer
from tests.mesh import MeshHarness, RegionMeshes, start_region_mesh
from tools.bench.spill_switch import SpillSwitch
from tools.bench.wait_times import WaitTimes, parts


def reply(message: Mapping[str, object]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def wait_times(mesh: MeshHarness) -> WaitTimes:
    """Where this region's own requests waited (``wait_times.py``), in every service."""
    times = WaitTimes()
    times.watch_gateway(next(s for s in mesh.services if isinstance(s, GatewayServer)))
    times.watch_detokenizer(next(s for s in mesh.services if isinstance(s, DetokenizerService)))
    for executor in mesh.executor_services:
        times.watch_executor(executor)
    return times


def region_parser(prog: str) -> argparse.ArgumentParser:
    """The flags of a region's child (this one and ``region_processes.py``)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--nats-url", required=True)
    p.add_argument("--region", required=True)
    p.add_argument("--peer-regions", default="", help="comma-separated")
    p.add_argument("--spill-queue-ms", type=float, default=300.0)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=15.0)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    p.add_argument("--executors", type=int, default=1, help="mixed ones")
    p.add_argument("--spill-reserve-executors", type=int, default=0)
    return p


def main() -> None:
    args = region_parser("python -m tools.bench.region_mesh").parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    peers = tuple(r for r in args.peer_regions.split(",") if r)
    mesh = start_region_mesh(
        args.model, args.region, (args.region, *peers), args.nats_url, args.step_ms / 1000,
        max_num_seqs=args.max_num_seqs, executors=args.executors,
        spill_queue_ms=args.spill_queue_ms, spill_reserve_executors=args.spill_reserve_executors,
        prefill_s_per_token=args.prefill_ms_per_token / 1000,
    )  # fmt: skip
    try:
        switch = SpillSwitch(RegionMeshes({args.region: mesh}).scheduler(args.region).spill)
        local = wait_times(mesh)
        reply({"base_url": mesh.base_url})
        for line in sys.stdin:
            command = line.split()
            if command[:1] == ["spill"] and command[1:] in (["on"], ["off"]):
                switch.set(command[1] == "on")
                reply({})
            elif command == ["spilled"]:
                reply({"spilled": switch.spilled()})
            elif command == ["rtt"]:
                reply({"rtt_ms": mesh.call(switch.rtt_ms())})
            elif command == ["local"]:
                reply(parts([local.take()]))
            elif command == ["preemptions"]:
                yielded = sum(e.engine_state().guests_yielded for e in mesh.executor_services)
                reply({"guests_yielded": yielded})
            elif command == ["stop"]:
                break
            else:
                reply({"error": f"unknown command {line.strip()!r}"})
    finally:
        mesh.stop()


if __name__ == "__main__":
    main()
