"""Two regions, one overloaded: goodput and TTFT with spillover against local-only, one run.

    python -m tools.bench.regions [--delay-ms 25] [--rounds 2] [--round-s 20]
                                  [--rate-east 18] [--rate-west 3] [--slo-ms 1000]
                                  [--executors 1] [--spill-reserve-executors 0]
                                  [--prompt-tokens 0] [--prefill-ms-per-token 0]
                                  [--processes] [--pin-regions]

Two regions (us-east, eu-west) on this machine: per region a two-server NATS cluster with
JetStream, joined by gateways whose every connection passes a TCP proxy that delays each byte
by ``--delay-ms`` one way (``tools/net/tcp_proxy.py``, a process of its own; a round trip
between the regions costs twice that), and a whole mesh per region (the tests' harness:
tokenizer, scheduler, prefix index, detokenizer, gateway, ``--executors`` executors, of which
``--spill-reserve-executors`` take no guests: ``services/scheduler/guests.py``) in a child
process of its own (``region_mesh.py``), so neither region's Python work takes the GIL from
the other; likewise each region's clients are a process of their own (a pool forked by this
one), so the overloaded region's streams do not delay, in the client's event loop, the
moment the quiet region's first tokens are read. Model: the tiny random Llama of the
tests; each executor runs at most ``--max-num-seqs`` sequences with a fixed ``--step-ms`` per
step (the model's own time is a fraction of a millisecond, so the sleep stands for a device
step; both regions share this machine's CPUs, and without it they would also share the
compute they are meant to add). By default a prompt is a short text (a few tokens) and a
step costs the same whatever it computes; ``--prompt-tokens N`` sends prompts of N random
token ids instead (no two share a cached page) and ``--prefill-ms-per-token`` adds that much
device time per prompt token a step computes, as a device's prefill costs (``paced.py``).
``--pin-regions`` puts each region's processes and NATS servers on cores of their own, as on
two hosts (``cpu_pin.py``).

Load: open-loop Poisson arrivals, the same seeded schedule for both sides: us-east at
``--rate-east`` requests/s (above its capacity), eu-west at ``--rate-west`` (below). Every
request streams exactly ``--output-tokens`` tokens; TTFT counts from the scheduled arrival.
Sides take turns per round (spill, local-only, spill, ...), switched by giving us-east's
scheduler its peer regions or none, after the previous round has drained.

Printed: per side, goodput (requests/s with TTFT <= ``--slo-ms``), TTFT p50/p99 of us-east's
and of eu-west's clients, and how many requests spilled each way; where eu-west's own
requests' first token waited (gateway -> executor, the executor's step in progress, their
first step, and the TTFT the gateway measured); then the goodput ratio and the change in
eu-west's local TTFT p50. Each child's log is under ``--log-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from services.launcher.nats_cluster import ClusterPlan, Supercluster
from tests.models import write_tiny_model
from tools.bench.cpu_pin import pin_process, pinned, region_cpus
from tools.bench.wait_times import WAIT_PARTS

REGIONS = ("us-east", "eu-west")


@dataclass
class Side:
    name: str
    ttft: dict[str, list[float]] = field(default_factory=lambda: {r: [] for r in REGIONS})
    failed: int = 0
    spilled: int = 0  # us-east -> eu-west
    spilled_back: int = 0  # eu-west -> us-east (its own clients' requests sent away)
    guests_yielded: int = 0  # guests eu-west's executors preempted for its own requests
    seconds: float = 0.0
    # where eu-west's own requests waited: part -> ms per request (region_mesh.py ``local``)
    west_waits: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def goodput(self, slo_s: float) -> float:
        good = sum(t <= slo_s for ts in self.ttft.values() for t in ts)
        return good / self.seconds if self.seconds else 0.0


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default, as loadtest and
    vLLM's benchmark take it; the nearest-rank pick made p99 the maximum of 100 values)."""
    if not values:
        return float("nan")
    return float(np.percentile(values, 100.0 * q))


# Token ids a long prompt draws from: below the tiny model's vocabulary (512), above the ids
# its tokenizer keeps for special tokens.
PROMPT_IDS = range(16, 500)


def prompt(prompt_tokens: int) -> str | list[int]:
    """A prompt no other request shares a page of: a short text, or ``prompt_tokens`` ids."""
    if not prompt_tokens:
        return f"region bench {random.random()}"
    return [random.choice(PROMPT_IDS) for _ in range(prompt_tokens)]


@dataclass(frozen=True)
class Shape:
    """What every request of a run asks for."""

    output_tokens: int
    prompt_tokens: int = 0  # 0: a short text


async def one(session: aiohttp.ClientSession, url: str, shape: Shape, due: float) -> float | None:
    """TTFT from the scheduled arrival ``due`` (``time.monotonic``), or None if it failed."""
    await asyncio.sleep(max(0.0, due - time.monotonic()))
    body = {
        "model": "tiny", "prompt": prompt(shape.prompt_tokens), "max_tokens": shape.output_tokens,
        "stream": True, "ignore_eos": True, "temperature": 0,
    }  # fmt: skip
    ttft, finished = None, False
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                print(f"a request failed: {resp.status} {await resp.text()}", file=sys.stderr)
                return None
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    finished = finished or line.startswith(b"data: [DONE]")
                    continue
                event = json.loads(line[6:])
                if "error" in event:  # a failure after the first token: a 200 all the same
                    print(f"a request failed mid-stream: {event['error']}", file=sys.stderr)
                    return None
                if ttft is None:
                    ttft = time.monotonic() - due
    except aiohttp.ClientError as exc:  # the connection cut mid-stream
        print(f"a request failed: {exc!r}", file=sys.stderr)
        return None
    return ttft if finished else None


async def region_round(
    url: str, rate: float, shape: Shape, round_s: float, seed: int, start: float
) -> list[float | None]:
    """One region's clients for one round: Poisson arrivals at ``rate`` from ``start``
    (``time.monotonic``, the same clock in every process) for ``round_s``; each one's TTFT, or
    None if it failed."""
    rng = random.Random(seed)
    dues = []
    t = start
    while True:
        t += rng.expovariate(rate)
        if t > start + round_s:
            break
        dues.append(t)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return list(await asyncio.gather(*(one(session, url, shape, due) for due in dues)))


def region_clients(
    url: str, rate: float, shape: Shape, round_s: float, seed: int, start: float
) -> list[float | None]:
    """``region_round`` in a process of the load generator's pool."""
    return asyncio.run(region_round(url, rate, shape, round_s, seed, start))


def run_round(
    clients: ProcessPoolExecutor,
    urls: dict[str, str],
    rates: dict[str, float],
    shape: Shape,
    round_s: float,
    seed: int,
) -> tuple[dict[str, list[float]], int]:
    """One round, each region's clients in a process of their own (module docstring)."""
    start = time.monotonic() + 0.5
    futures = {
        region: clients.submit(
            region_clients, urls[region] + "/completions", rates[region], shape, round_s,
            1000 * seed + i, start,
        )
        for i, region in enumerate(REGIONS)
    }  # fmt: skip
    ttft: dict[str, list[float]] = {r: [] for r in REGIONS}
    failed = 0
    for region, future in futures.items():
        for result in future.result():
            if result is None:
                failed += 1
            else:
                ttft[region].append(result)
    return ttft, failed


class Child:
    """A child process spoken to in lines: its first line of JSON when it is up, then one JSON
    reply per command (``region_mesh.py``'s protocol)."""

    def __init__(self, cmd: list[str], log: Path, cpus: set[int] | None = None) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            preexec_fn=pinned(cpus),
        )

    def read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"a child exited ({code}): see {self.log.name}")
        return json.loads(line)

    def ask(self, command: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self.read()
        if isinstance(answer, dict) and "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def stop(self) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # end of input: the child stops its mesh and exits
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench.regions")
    p.add_argument("--delay-ms", type=float, default=25.0, help="one way, on the gateway link")
    p.add_argument("--rounds", type=int, default=2, help="rounds per side")
    p.add_argument("--round-s", type=float, default=20.0)
    p.add_argument("--rate-east", type=float, default=18.0)
    p.add_argument("--rate-west", type=float, default=3.0)
    p.add_argument("--slo-ms", type=float, default=1000.0)
    p.add_argument("--spill-queue-ms", type=float, default=300.0)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=0, help="0: a short text prompt")
    p.add_argument(
        "--prefill-ms-per-token", type=float, default=0.0, help="device time per prompt token"
    )
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=15.0)
    p.add_argument("--executors", type=int, default=1, help="per region, both alike")
    p.add_argument(
        "--disaggregated",
        metavar="P,D",
        default="",
        help="with --processes: per region P prefill and D decode executors (KV by NIXL) "
        "besides the --executors mixed ones",
    )
    p.add_argument(
        "--spill-reserve-executors",
        type=int,
        default=0,
        help="per region: executors that take no guests (0 here, not the scheduler's 1, so "
        "the one-executor runs recorded before it still mean the same command)",
    )
    p.add_argument(
        "--processes",
        action="store_true",
        help="each region's services a process each, as meshserve up runs them "
        "(region_processes.py), not one process per region (region_mesh.py)",
    )
    p.add_argument(
        "--pin-regions",
        action="store_true",
        help="each region's processes and NATS servers on cores of their own, as on separate "
        "hosts (cpu_pin.py); the clients and the proxy run anywhere",
    )
    p.add_argument("--log-dir", type=Path, default=Path("out/bench_regions"))
    args = p.parse_args()
    if args.disaggregated and not args.processes:
        p.error("--disaggregated needs --processes")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()[0]
    # (the tiny model's 256 positions would refuse a long prompt with its output)
    positions = max(256, args.prompt_tokens + args.output_tokens)
    model = write_tiny_model(
        Path(tempfile.mkdtemp(prefix="bench-regions-")) / "llama",
        max_position_embeddings=positions,
    )
    plans = [ClusterPlan.free(r, 2, gateways=True) for r in REGIONS]
    ports = [port for plan in plans for port in plan.gateway_ports]
    proxy = Child(
        [sys.executable, "-m", "tools.net.tcp_proxy", "--delay-ms", str(args.delay_ms),
         *map(str, ports)],
        args.log_dir / "proxy.log",
    )  # fmt: skip
    children = [proxy]
    clients: ProcessPoolExecutor | None = None
    supercluster: Supercluster | None = None
    try:
        addresses = iter(proxy.read())
        supercluster = Supercluster.start(
            plans, {plan.name: [next(addresses) for _ in plan.gateway_ports] for plan in plans}
        )
        supercluster.wait_jetstream()
        cpus: dict[str, set[int]] = {}
        if args.pin_regions:
            cpus = {r: region_cpus(i, len(REGIONS)) for i, r in enumerate(REGIONS)}
        for region, region_cores in cpus.items():
            for server in filter(None, supercluster.clusters[region].servers):
                pin_process(server.process.pid, region_cores)
        meshes: dict[str, Child] = {}
        program = "region_processes" if args.processes else "region_mesh"
        urls: dict[str, str] = {}
        for region in REGIONS:
            flags = ["--log-dir", str(args.log_dir)] if args.processes else []
            if args.disaggregated:
                prefill, decode = args.disaggregated.split(",")
                flags += ["--prefill-executors", prefill, "--decode-executors", decode]
            meshes[region] = Child(
                [sys.executable, "-m", f"tools.bench.{program}", *flags, "--model", str(model),
                 "--nats-url", supercluster.clusters[region].url, "--region", region,
                 "--peer-regions", ",".join(r for r in REGIONS if r != region),
                 "--spill-queue-ms", str(args.spill_queue_ms),
                 "--max-num-seqs", str(args.max_num_seqs), "--step-ms", str(args.step_ms),
                 "--prefill-ms-per-token", str(args.prefill_ms_per_token),
                 "--executors", str(args.executors),
                 "--spill-reserve-executors", str(args.spill_reserve_executors)],
                args.log_dir / f"{region}.log",
                cpus.get(region),
            )  # fmt: skip
            children.append(meshes[region])
        for region in REGIONS:  # both start at once: each imports torch and builds its mesh
            urls[region] = meshes[region].read()["base_url"]
        east = meshes["us-east"]
        rtt = east.ask("rtt")["rtt_ms"]
        meshes["eu-west"].ask("local")  # (nothing yet; the warm-up's are dropped below)
        rates = {"us-east": args.rate_east, "eu-west": args.rate_west}
        # forked now: no thread of this process runs, and the workers need no imports of their own
        clients = ProcessPoolExecutor(len(REGIONS), mp_context=multiprocessing.get_context("fork"))
        shape = Shape(args.output_tokens, args.prompt_tokens)
        run_round(clients, urls, {r: 2.0 for r in REGIONS}, shape, 3.0, seed=0)
        meshes["eu-west"].ask("local")
        sides = {"spillover": Side("spillover"), "local-only": Side("local-only")}
        for round_no in range(args.rounds):
            for name, switch in (("spillover", "spill on"), ("local-only", "spill off")):
                east.ask(switch)  # the bench's switch between the two sides
                side = sides[name]
                before = east.ask("spilled")["spilled"]
                before_back = meshes["eu-west"].ask("spilled")["spilled"]
                yielded_before = meshes["eu-west"].ask("preemptions")["guests_yielded"]
                ttft, failed = run_round(
                    clients, urls, rates, shape, args.round_s, seed=round_no + 1
                )
                for region in REGIONS:
                    side.ttft[region] += ttft[region]
                side.failed += failed
                side.spilled += east.ask("spilled")["spilled"] - before
                side.spilled_back += meshes["eu-west"].ask("spilled")["spilled"] - before_back
                yielded = meshes["eu-west"].ask("preemptions")["guests_yielded"]
                side.guests_yielded += yielded - yielded_before
                side.seconds += args.round_s
                for part, times in meshes["eu-west"].ask("local").items():
                    side.west_waits[part] += times
                print(f"round {round_no} {name}: done", flush=True)
        report(sides, args, rtt)
        load_at_end = os.getloadavg()[0]
        print(f"load average: {load_at_start:.1f} at the start, {load_at_end:.1f} at the end")
        if cpus:
            print("cores: " + ", ".join(f"{r} {sorted(c)}" for r, c in cpus.items()))
    finally:
        if clients is not None:
            clients.shutdown(cancel_futures=True)
        for child in reversed(children):
            child.stop()
        if supercluster is not None:
            supercluster.stop()


def print_waits(sides: dict[str, Side]) -> None:
    print(
        "\nwhere eu-west's own clients' first token waits, p50 (mean) ms: gateway -> executor | "
        "in the executor, the step in progress | its first step | -> the detokenizer | "
        "-> the gateway | -> its handler | TTFT at the gateway"
    )
    for side in sides.values():
        waits = [side.west_waits[p] for p in WAIT_PARTS]
        print(
            f"  {side.name}: "
            + " | ".join(
                f"{percentile(w, 0.5):.1f} ({statistics.fmean(w or [0]):.1f})" for w in waits
            )
        )


def report(sides: dict[str, Side], args: argparse.Namespace, rtt_ms: float) -> None:
    slo = args.slo_ms / 1000
    print(
        f"\ninter-region RTT measured by the schedulers: {rtt_ms:.0f} ms "
        f"(injected {2 * args.delay_ms:.0f} ms); SLO TTFT <= {args.slo_ms:.0f} ms; "
        f"{args.rounds} x {args.round_s:.0f} s per side\n"
    )
    print("| side | goodput req/s | us-east TTFT p50 / p99 ms | eu-west TTFT p50 / p99 ms "
          "| spilled east -> west / west -> east | guests preempted | failed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for side in sides.values():
        e, w = side.ttft["us-east"], side.ttft["eu-west"]
        print(
            f"| {side.name} | {side.goodput(slo):.2f} | "
            f"{1000 * percentile(e, 0.5):.0f} / {1000 * percentile(e, 0.99):.0f} | "
            f"{1000 * percentile(w, 0.5):.0f} / {1000 * percentile(w, 0.99):.0f} | "
            f"{side.spilled} / {side.spilled_back} | {side.guests_yielded} | {side.failed} |"
        )
    if not args.disaggregated:  # (a first token there comes from another executor)
        print_waits(sides)
    spill, local = sides["spillover"], sides["local-only"]
    ratio = spill.goodput(slo) / max(local.goodput(slo), 1e-9)
    west = percentile(spill.ttft["eu-west"], 0.5) / percentile(local.ttft["eu-west"], 0.5) - 1
    print(f"\ngoodput ratio spillover / local-only: {ratio:.2f}x (target >= 1.5x)")
    print(f"eu-west local TTFT p50 change with spillover: {100 * west:+.1f}% (target <= +10%)")


if __name__ == "__main__":
    main()
