"""One service of a region's mesh in a process of its own, as ``meshserve up --regions`` runs
it, with what the regions bench (``region_processes.py``) needs of it:

    python -m tools.bench.region_service services.executor --bench-name NAME \\
        [--bench-step-ms 15] [--bench-prefill-ms-per-token 0] EXECUTOR FLAGS...

- ``services.executor``: each engine step takes ``--bench-step-ms`` longer, and
  ``--bench-prefill-ms-per-token`` more per prompt token it computes (device time; see
  ``regions.py``), and it records where its region's own requests waited;
- ``services.gateway``: it records the TTFT of each of its clients' requests;
- ``services.detokenizer``: it records when it turned to each stream's first tokens;
- ``services.scheduler``: its spilling can be switched on and off between rounds.

Each answers on ``bench.control.<NAME>`` (request/reply, JSON): ``local`` (executor, gateway,
detokenizer: the moments ``wait_times.py`` stamped since the last ``local``), ``preemptions``
(executor: ``{"guests_yielded": n}`` since it started), ``spill on`` /
``spill off``, ``spilled`` (requests sent to another region so far), ``rtt`` (the round trip
to the peers, ms).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from common.runtime import Service, run, run_service, serve_until_shutdown

if TYPE_CHECKING:  # (imported where used: the scheduler's process needs no torch)
    from tools.bench.wait_times import WaitTimes

BENCH_SERVICES = (
    "services.executor", "services.gateway", "services.scheduler", "services.detokenizer",
)  # fmt: skip
Handlers = dict[str, Callable[[], Awaitable[Any]]]


def control_subject(name: str) -> str:
    return f"bench.control.{name}"


def answer_on(name: str, service: Any, svc: Service, handlers: Handlers) -> None:
    """Once ``service`` has started, answer the bench's commands on its connection."""
    start = service.start

    async def start_then_answer() -> None:
        await start()

        async def on_command(msg: Any) -> None:
            handler = handlers.get(msg.data.decode())
            try:
                reply = await handler() if handler else {"error": f"unknown {msg.data!r}"}
            except Exception as exc:  # the bench reports it; the service keeps serving
                reply = {"error": repr(exc)}
            await msg.respond(json.dumps(reply).encode())

        await svc.nc.subscribe(control_subject(name), cb=on_command)

    service.start = start_then_answer


def answer_local(
    name: str, service: Any, svc: Service, times: WaitTimes, more: Handlers | None = None
) -> None:
    """``local``: the moments ``times`` stamped since the last ``local`` (and ``more``)."""

    async def local() -> Any:
        return times.take()

    answer_on(name, service, svc, {"local": local, **(more or {})})


def executor(name: str, step_s: float, prefill_s_per_token: float) -> None:
    from services.executor.__main__ import build, drain_and_stop
    from services.executor.config import ExecutorConfig, parse_args
    from services.executor.service import ExecutorService
    from tools.bench.paced import slow_step
    from tools.bench.wait_times import WaitTimes

    async def build_paced(config: ExecutorConfig) -> ExecutorService:
        service = await build(config)
        slow_step(service, step_s, prefill_s_per_token)
        times = WaitTimes()
        times.watch_executor(service)

        async def preemptions() -> Any:
            state = service.engine_state()
            return {"guests_yielded": state.guests_yielded}

        answer_local(name, service, service.svc, times, {"preemptions": preemptions})
        return service

    run_service("executor", parse_args, build_paced, drain_and_stop)


def gateway(name: str, argv: list[str]) -> None:
    from services.gateway.app import GatewayServer
    from services.gateway.config import serving_config
    from tools.bench.wait_times import WaitTimes

    config = serving_config(argv)

    async def main() -> None:
        server = GatewayServer(config)
        times = WaitTimes()
        times.watch_gateway(server)
        answer_local(name, server, server.mesh.service, times)
        await serve_until_shutdown(server.mesh.service, server.start, server.stop)

    run(main)


def detokenizer(name: str) -> None:
    from services.detokenizer.service import DetokenizerService, parse_args
    from tools.bench.wait_times import WaitTimes

    def build(config: Any) -> DetokenizerService:
        service = DetokenizerService(config)
        times = WaitTimes()
        times.watch_detokenizer(service)
        answer_local(name, service, service.svc, times)
        return service

    run_service("detokenizer", parse_args, build)


def scheduler(name: str) -> None:
    from services.scheduler.service import SchedulerService, SchedulerServiceConfig, parse_args
    from tools.bench.spill_switch import SpillSwitch

    def build(config: SchedulerServiceConfig) -> SchedulerService:
        service = SchedulerService(config)
        switch = SpillSwitch(service.spill)

        def turn(on: bool) -> Callable[[], Awaitable[Any]]:
            async def set_config() -> Any:
                switch.set(on)
                return {}

            return set_config

        async def spilled() -> Any:
            return {"spilled": switch.spilled()}

        async def rtt() -> Any:
            return {"rtt_ms": await switch.rtt_ms()}

        handlers = {"spill on": turn(True), "spill off": turn(False)}
        answer_on(name, service, service.svc, {**handlers, "spilled": spilled, "rtt": rtt})
        return service

    run_service("scheduler", parse_args, build)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench.region_service")
    p.add_argument("module", choices=BENCH_SERVICES)
    p.add_argument("--bench-name", required=True)
    p.add_argument("--bench-step-ms", type=float, default=15.0)
    p.add_argument("--bench-prefill-ms-per-token", type=float, default=0.0)
    args, rest = p.parse_known_args()
    sys.argv = [f"{sys.argv[0]} {args.module}", *rest]  # what the service parses
    if args.module == "services.executor":
        executor(args.bench_name, args.bench_step_ms / 1000, args.bench_prefill_ms_per_token / 1000)
    elif args.module == "services.gateway":
        gateway(args.bench_name, rest)
    elif args.module == "services.detokenizer":
        detokenizer(args.bench_name)
    else:
        scheduler(args.bench_name)


if __name__ == "__main__":
    main()
