"""One region's mesh as ``meshserve up --regions`` runs it, a process per service, driven
over stdin by ``tools.bench.regions --processes``:

    python -m tools.bench.region_processes --model DIR --nats-url URLS --region eu-west \\
        --peer-regions us-east [--spill-queue-ms 300] [--max-num-seqs 4] [--step-ms 15] \\
        [--executors 1] [--prefill-executors 0 --decode-executors 0] \\
        [--spill-reserve-executors 0] [--log-dir DIR]

The same protocol as ``region_mesh.py`` (one JSON line once every service answers, then one per
command: ``spill on|off``, ``spilled``, ``rtt``, ``local``, ``stop``), answered by asking the
services themselves (``region_service.py``: the scheduler, the gateway, each executor). What
``region_mesh.py`` runs in one interpreter (a whole region's services in one event loop, so
a guest's stream takes turns with the region's own on the way back to the gateway) runs
here as deployed: each service has its own loop and GIL, and the machine's cores are shared
by the operating system.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import nats.errors

from common.nats_server import free_port
from services.launcher.console import ServiceLogs
from services.launcher.regions import RegionMesh
from services.launcher.up import parse_up_args
from tools.bench.region_mesh import region_parser, reply
from tools.bench.region_service import BENCH_SERVICES, control_subject
from tools.bench.wait_times import parts


@dataclass
class BenchRegionMesh(RegionMesh):
    """``RegionMesh`` with its executors, gateway and scheduler run by ``region_service.py``."""

    step_ms: float = 15.0
    prefill_ms_per_token: float = 0.0
    spill_reserve_executors: int = 0

    def spawn(self, name: str, module: str, *flags: str) -> None:
        if module == "services.scheduler" and len(self.executor_roles) > 1:
            flags = (*flags, "--spill-reserve-executors", str(self.spill_reserve_executors))
        # as region_mesh.py logs: warnings only (not a line per request to the disk)
        super().spawn(name, module, *flags, "--log-level", "WARNING")

    def popen(self, name: str) -> Any:
        cmd = self.commands[name]
        at = cmd.index("-m")
        if cmd[at + 1] in BENCH_SERVICES:
            self.commands[name] = [
                *cmd[:at], "-m", "tools.bench.region_service", cmd[at + 1],
                "--bench-name", name, "--bench-step-ms", str(self.step_ms),
                "--bench-prefill-ms-per-token", str(self.prefill_ms_per_token), *cmd[at + 2:],
            ]  # fmt: skip
        return super().popen(name)


async def ask(nc: Any, name: str, command: str) -> Any:
    try:
        msg = await nc.request(control_subject(name), command.encode(), timeout=30)
    except nats.errors.Error as exc:
        raise RuntimeError(f"{name} did not answer {command!r}: {exc!r}") from exc
    answer = json.loads(msg.data)
    if isinstance(answer, dict) and "error" in answer:
        raise RuntimeError(f"{name}: {answer['error']}")
    return answer


async def until_answered(nc: Any, names: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for name in names:
        while True:
            try:
                await nc.request(control_subject(name), b"ping", timeout=1)
                break
            except nats.errors.Error:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not come up within {timeout:.0f} s") from None
                await asyncio.sleep(0.2)


async def serve_commands(mesh: BenchRegionMesh, nats_url: str) -> None:
    nc = await nats.connect(nats_url.split(","))
    names = [name for name, _ in mesh.procs]
    scheduler = next(n for n in names if n.endswith("-scheduler"))
    kinds = ("-executor-", "-prefill-", "-decode-")
    executors = [n for n in names if any(part in n + "-" for part in kinds)]
    stamping = ("-gateway", "-detokenizer-", *kinds)
    watched = [n for n in names if any(part in n + "-" for part in stamping)]
    loop = asyncio.get_running_loop()
    try:
        # Up when every bench-run service answers: the gateway is healthy before any executor
        # (a region's gateway does not require one), and an executor loads its model first.
        await until_answered(nc, [scheduler, *watched], timeout=180)
        reply({"base_url": mesh.base_url + "/v1"})
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command = line.strip()
            if command in ("spill on", "spill off", "spilled", "rtt"):
                reply(await ask(nc, scheduler, command))
            elif command == "local":
                reply(parts(list(await asyncio.gather(*(ask(nc, n, "local") for n in watched)))))
            elif command == "preemptions":
                counts = await asyncio.gather(*(ask(nc, n, command) for n in executors))
                reply({"guests_yielded": sum(c["guests_yielded"] for c in counts)})
            elif command == "stop":
                break
            else:
                reply({"error": f"unknown command {command!r}"})
    finally:
        await nc.close()


def main() -> None:
    p = region_parser("python -m tools.bench.region_processes")
    p.add_argument("--prefill-executors", type=int, default=0)
    p.add_argument("--decode-executors", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=Path("out/bench_regions"))
    args = p.parse_args()
    up = parse_up_args(
        [
            "--model", str(args.model), "--nats-url", args.nats_url, "--port", str(free_port()),
            "--executors", str(args.executors), "--max-num-seqs", str(args.max_num_seqs),
            "--prefill-executors", str(args.prefill_executors),
            "--decode-executors", str(args.decode_executors),
            "--router", "least-load",  # as region_mesh.py's harness routes
            "--page-size", "16", "--kv-cache-tokens", "4096", "--served-model-name", "tiny",
        ]
    )  # fmt: skip
    logs = ServiceLogs(args.log_dir / args.region)  # one file per service
    mesh = BenchRegionMesh(
        up,
        args.model,
        logs=logs,
        region=args.region,
        peers=tuple(r for r in args.peer_regions.split(",") if r),
        kv_replicas=2,
        spill_queue_ms=args.spill_queue_ms,
        step_ms=args.step_ms,
        prefill_ms_per_token=args.prefill_ms_per_token,
        spill_reserve_executors=args.spill_reserve_executors,
    )
    # every region's executors share this machine's cores (--cpu-threads: their share)
    mesh.executors_on_host = (1 + len(mesh.peers)) * len(mesh.executor_roles)
    try:
        mesh.start()
        mesh.wait_ready(180)
        asyncio.run(serve_commands(mesh, args.nats_url))
    finally:
        mesh.stop()


if __name__ == "__main__":
    main()
