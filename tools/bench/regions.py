"""Two regions, one overloaded: goodput and TTFT with spillover against local-only, one run.

    python -m tools.bench.regions [--delay-ms 25] [--rounds 2] [--round-s 20]
                                  [--rate-east 10] [--rate-west 2] [--slo-ms 1000]

Two regions (us-east, eu-west) on this machine: per region a two-server NATS cluster with
JetStream, joined by gateways whose every connection passes a TCP proxy that delays each byte
by ``--delay-ms`` one way (``tools/net/tcp_proxy.py``; a round trip between the regions costs
twice that), and a whole mesh per region (the in-process harness of the tests:
tokenizer, scheduler, prefix index, detokenizer, gateway, one executor). Model: the tiny random
Llama of the tests; each executor runs at most ``--max-num-seqs`` sequences with a fixed
``--step-ms`` per step (the model's own time is a fraction of a millisecond, so the sleep
stands for a device step; both regions share this machine's CPUs, and without it they would
also share the compute they are meant to add).

Load: open-loop Poisson arrivals, the same seeded schedule for both sides: us-east at
``--rate-east`` requests/s (above its capacity), eu-west at ``--rate-west`` (below). Every
request streams exactly ``--output-tokens`` tokens; TTFT counts from the scheduled arrival.
Sides take turns per round (spill, local-only, spill, ...), switched by giving us-east's
scheduler its peer regions or none, after the previous round has drained.

Printed: per side, goodput (requests/s with TTFT <= ``--slo-ms``), TTFT p50/p99 of us-east's
and of eu-west's clients, and how many requests spilled; then the goodput ratio and the change
in eu-west's local TTFT p50.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from services.launcher.nats_cluster import ClusterPlan, Supercluster
from services.scheduler.regions import RegionConfig
from services.scheduler.service import SchedulerService
from tests.mesh import MeshHarness
from tests.models import write_tiny_model
from tools.net.tcp_proxy import DelayProxy

REGIONS = ("us-east", "eu-west")


@dataclass
class Side:
    name: str
    ttft: dict[str, list[float]] = field(default_factory=lambda: {r: [] for r in REGIONS})
    failed: int = 0
    spilled: int = 0
    seconds: float = 0.0

    def goodput(self, slo_s: float) -> float:
        good = sum(t <= slo_s for ts in self.ttft.values() for t in ts)
        return good / self.seconds if self.seconds else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one(session: aiohttp.ClientSession, url: str, tokens: int, due: float) -> float | None:
    """TTFT from the scheduled arrival ``due`` (perf_counter), or None if it failed."""
    await asyncio.sleep(max(0.0, due - time.perf_counter()))
    body = {
        "model": "tiny", "prompt": f"region bench {random.random()}", "max_tokens": tokens,
        "stream": True, "ignore_eos": True, "temperature": 0,
    }  # fmt: skip
    ttft = None
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return None
        async for line in resp.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - due
    return ttft


async def run_round(
    meshes: dict[str, MeshHarness], rates: dict[str, float], args: argparse.Namespace, seed: int
) -> tuple[dict[str, list[float]], int]:
    rng = random.Random(seed)
    start = time.perf_counter() + 0.5
    jobs = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for region in REGIONS:
            t = start
            url = meshes[region].base_url + "/completions"
            while True:
                t += rng.expovariate(rates[region])
                if t > start + args.round_s:
                    break
                jobs.append((region, one(session, url, args.output_tokens, t)))
        results = await asyncio.gather(*(job for _, job in jobs))
    ttft: dict[str, list[float]] = {r: [] for r in REGIONS}
    failed = 0
    for (region, _), result in zip(jobs, results, strict=True):
        if result is None:
            failed += 1
        else:
            ttft[region].append(result)
    return ttft, failed


def spilled_count(sched: SchedulerService) -> int:
    samples = [s for m in sched.spill.spilled_total.collect() for s in m.samples]
    return int(sum(s.value for s in samples if s.name.endswith("_total")))


async def measure_rtt(sched: SchedulerService, timeout: float = 20) -> float:
    deadline = time.monotonic() + timeout
    while not sched.spill.remotes(1):
        if time.monotonic() > deadline:
            raise TimeoutError("no load report crossed the gateway link")
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    return statistics.median(p.rtt_ms for p in sched.spill.peers.values())


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
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=15.0)
    args = p.parse_args()
    model = write_tiny_model(Path(tempfile.mkdtemp(prefix="bench-regions-")) / "llama")
    plans = [ClusterPlan.free(r, 2, gateways=True) for r in REGIONS]
    proxies = {
        plan.name: [DelayProxy(port, args.delay_ms / 1000).start() for port in plan.gateway_ports]
        for plan in plans
    }
    supercluster = Supercluster.start(
        plans, {r: [proxy.address for proxy in ps] for r, ps in proxies.items()}
    )
    meshes: dict[str, MeshHarness] = {}
    try:
        supercluster.wait_jetstream()
        for region in REGIONS:
            regions = RegionConfig(
                peer_regions=tuple(r for r in REGIONS if r != region),
                spill_queue_ms=args.spill_queue_ms,
            )
            mesh = MeshHarness(
                model,
                max_num_seqs=args.max_num_seqs,
                nats_url=supercluster.clusters[region].url,
                region=region,
                kv_replicas=2,
                required_stages=("tokenizer", "scheduler", "detokenizer"),
                scheduler_options={"regions": regions},
            )
            meshes[region] = mesh.start()
            mesh.slow_steps(args.step_ms / 1000)
        east = next(s for s in meshes["us-east"].services if isinstance(s, SchedulerService))
        spill_config = east.spill.config
        local_config = dataclasses.replace(spill_config, peer_regions=())
        rtt = asyncio.run(measure_rtt(east))
        rates = {"us-east": args.rate_east, "eu-west": args.rate_west}
        asyncio.run(run_round(meshes, {r: 2.0 for r in REGIONS}, argparse.Namespace(
            round_s=3.0, output_tokens=args.output_tokens), seed=0))  # fmt: skip
        sides = {"spillover": Side("spillover"), "local-only": Side("local-only")}
        for round_no in range(args.rounds):
            for name, config in (("spillover", spill_config), ("local-only", local_config)):
                east.spill.config = config  # the bench's switch between the two sides
                side = sides[name]
                before = spilled_count(east)
                ttft, failed = asyncio.run(run_round(meshes, rates, args, seed=round_no + 1))
                for region in REGIONS:
                    side.ttft[region] += ttft[region]
                side.failed += failed
                side.spilled += spilled_count(east) - before
                side.seconds += args.round_s
                print(f"round {round_no} {name}: done", flush=True)
        east.spill.config = spill_config
        report(sides, args, rtt)
    finally:
        for mesh in meshes.values():
            mesh.stop()
        for ps in proxies.values():
            for proxy in ps:
                proxy.stop()
        supercluster.stop()


def report(sides: dict[str, Side], args: argparse.Namespace, rtt_ms: float) -> None:
    slo = args.slo_ms / 1000
    print(
        f"\ninter-region RTT measured by the schedulers: {rtt_ms:.0f} ms "
        f"(injected {2 * args.delay_ms:.0f} ms); SLO TTFT <= {args.slo_ms:.0f} ms; "
        f"{args.rounds} x {args.round_s:.0f} s per side\n"
    )
    print("| side | goodput req/s | us-east TTFT p50 / p99 ms | eu-west TTFT p50 / p99 ms "
          "| spilled | failed |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for side in sides.values():
        e, w = side.ttft["us-east"], side.ttft["eu-west"]
        print(
            f"| {side.name} | {side.goodput(slo):.2f} | "
            f"{1000 * percentile(e, 0.5):.0f} / {1000 * percentile(e, 0.99):.0f} | "
            f"{1000 * percentile(w, 0.5):.0f} / {1000 * percentile(w, 0.99):.0f} | "
            f"{side.spilled} | {side.failed} |"
        )
    spill, local = sides["spillover"], sides["local-only"]
    ratio = spill.goodput(slo) / max(local.goodput(slo), 1e-9)
    west = percentile(spill.ttft["eu-west"], 0.5) / percentile(local.ttft["eu-west"], 0.5) - 1
    print(f"\ngoodput ratio spillover / local-only: {ratio:.2f}x (target >= 1.5x)")
    print(f"eu-west local TTFT p50 change with spillover: {100 * west:+.0f}% (target <= +10%)")


if __name__ == "__main__":
    main()
