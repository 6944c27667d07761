"""Several CPU executors with their share of the cores (``--cpu-threads``, what ``meshserve up``
now passes) against each with torch's default of a thread per core, in one run.

    python -m tools.bench.cpu_threads [--model PATH] [--executors 2] [--concurrency 1,8]
                                      [--requests 32] [--output-tokens 64] [--rounds 2]

Per round and side: ``meshserve up --executors N`` as a fresh mesh (``LocalMesh``; the
``default`` side's executors get ``--cpu-threads 0``), an untimed warm-up batch, then for each
``--concurrency`` a closed loop of that many streaming clients over ``--requests`` greedy chat
requests of exactly ``--output-tokens`` tokens (``tools/bench/mesh.py``'s client). The sides
take turns (shared, default, shared, ...). Printed: output tokens/s and TTFT p50/p99 per side
and concurrency (the round with the median throughput), and the ratio shared / default.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from common.nats_server import free_port
from gpu.gguf import resolve_model_path
from services.launcher.mesh import LocalMesh
from services.launcher.up import parse_up_args
from tools.bench.mesh import Side, median_side, questions, run_mesh, warmup_questions

SIDES = ("shared", "default")


class DefaultThreadsMesh(LocalMesh):
    """Each executor with torch's default threads, as ``meshserve up`` ran them before."""

    @property
    def cpu_threads(self) -> int:
        return 0


def run_side(side: str, args: argparse.Namespace, round_: int) -> dict[int, Side]:
    up = parse_up_args(
        ["--model", str(args.folder), "--executors", str(args.executors),
         "--port", str(free_port()), "--served-model-name", "bench"]
    )  # fmt: skip
    mesh = (LocalMesh if side == "shared" else DefaultThreadsMesh)(up, args.folder)
    url = mesh.base_url
    try:
        mesh.start()
        mesh.wait_ready(600)
        widest = max(args.concurrency)
        asyncio.run(run_mesh(url, "bench", warmup_questions(widest), 8, concurrency=widest))
        results = {}
        for c in args.concurrency:
            texts = questions(args.requests, round_, f"c{c}")
            results[c] = asyncio.run(run_mesh(url, "bench", texts, args.output_tokens, c))
        return results
    finally:
        mesh.stop()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench.cpu_threads")
    p.add_argument("--model", default=None)
    p.add_argument("--executors", type=int, default=2)
    p.add_argument("--concurrency", default="1,8", help="comma-separated")
    p.add_argument("--requests", type=int, default=32, help="per concurrency and round")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    args.folder = resolve_model_path(args.model)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    runs: dict[str, dict[int, list[Side]]] = {s: {c: [] for c in args.concurrency} for s in SIDES}
    for r in range(args.rounds):
        for side in SIDES:
            for c, result in run_side(side, args, r).items():
                runs[side][c].append(result)
            print(f"round {r} {side}: done", flush=True)
    cores = os.cpu_count() or 1
    print(
        f"\n{args.folder.name}, {args.executors} CPU executors on {cores} cores: "
        f"shared = --cpu-threads {max(1, cores // args.executors)} each, default = torch's "
        f"{cores} each; {args.requests} requests x {args.output_tokens} tokens, "
        f"median of {args.rounds} rounds\n"
    )
    print("| concurrency | side | output tok/s | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|")
    for c in args.concurrency:
        for side in SIDES:
            best = median_side(runs[side][c])
            print(
                f"| {c} | {side} | {best.tokens_per_s:.1f} | {best.ttft(50):.0f} | "
                f"{best.ttft(99):.0f} |"
            )
    for c in args.concurrency:
        ratio = median_side(runs["shared"][c]).tokens_per_s / max(
            median_side(runs["default"][c]).tokens_per_s, 1e-9
        )
        print(f"concurrency {c}: shared / default throughput {ratio:.2f}x")


if __name__ == "__main__":
    main()
