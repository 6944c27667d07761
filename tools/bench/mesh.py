"""The same workloads through the whole mesh and through the in-process engine, side by side.

    python -m tools.bench.mesh [--model PATH] [--concurrency 16] [--requests 64]
                             [--output-tokens 64] [--rounds 3] [--rate-fraction 0.5]

Both sides get the same chat prompts, the same engine settings, greedy decoding and exactly
``--output-tokens`` tokens per request (ignore_eos), after the same untimed warm-up batch. The
mesh runs as ``meshserve up`` would (nats-server plus one process per service) and is driven
over HTTP with streaming; the in-process side calls ``Engine.step()`` directly. The two sides
take turns for ``--rounds`` rounds (each round's prompts are new to both prefix caches), so a
shared machine's drifting load falls on both alike. Two workloads:

- throughput: a closed loop of ``--concurrency`` clients (a finished request's client sends
  its next one at once), the server saturated;
- latency: open-loop Poisson arrivals (the same seeded schedule on both sides) at
  ``--rate-fraction`` of the in-process side's closed-loop request rate. TTFT counts from the
  scheduled arrival, so on both sides a request that arrives mid-step waits for that step; in
  the closed loop the in-process clients always arrive exactly between steps, which no network
  client can, so its TTFT comparison would charge the step boundary to the mesh.

Printed: one row per round, side and workload, then the median round of each; the throughput
ratio (closed loop) and the TTFT the mesh adds at p50 and p99 (open loop).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from common.tokenizer import Tokenizer
from gpu.engine import Engine
from gpu.sampling_params import SamplingParams
from loadtest.client import Endpoint, RequestResult, send_request
from loadtest.runner import new_session
from loadtest.workloads import RequestSpec
from services.launcher.mesh import LocalMesh
from tools.bench.engine import QUESTIONS
from tools.bench.up_engine import up_engine

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Side:
    name: str
    seconds: float
    output_tokens: int
    ttfts_ms: list[float]
    requests: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    def ttft(self, q: float) -> float:
        """Percentile ``q``, interpolated between the samples as ``loadtest`` and vLLM's
        benchmark do (``statistics.quantiles``' default extrapolates past the largest one
        when there are fewer than 100)."""
        return float(np.percentile(self.ttfts_ms, q))


IN_PROCESS = "in-process engine"
MESH = "mesh (HTTP/SSE, NATS)"


def questions(n: int, round_: int = 0, kind: str = "closed") -> list[str]:
    return [
        f"{QUESTIONS[i % len(QUESTIONS)]} ({kind} round {round_}, request {i})" for i in range(n)
    ]


def warmup_questions(n: int) -> list[str]:
    """Prompts for the untimed warm-up of each side (first calls of new shapes are slow): one
    batch as wide as the run's, sharing no text with the timed prompts beyond the template."""
    return [f"Say hello to warm-up guest number {i}." for i in range(n)]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of ``n`` requests arrives (exponential gaps)."""
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def run_in_process(
    tokenizer: Tokenizer,
    engine: Engine,
    texts: list[str],
    output_tokens: int,
    concurrency: int | None = None,
    arrivals: list[float] | None = None,
) -> Side:
    """Closed loop at ``concurrency``, or open loop at the ``arrivals`` times."""
    prompts = deque(texts)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    pending = deque(arrivals or [])
    started: dict[str, float] = {}
    ttfts: list[float] = []
    produced = n = 0
    t0 = time.perf_counter()

    def admit(rid: str, at: float) -> None:
        # Tokenized on arrival, inside the request's time, as the mesh's tokenizer does.
        engine.add_request(rid, tokenizer.encode_user_turn(prompts.popleft()), params)
        started[rid] = at

    while prompts or engine.has_unfinished():
        if arrivals is None:
            while prompts and len(started) < (concurrency or 1):
                admit(f"bench-{n}", time.perf_counter())
                n += 1
        else:
            while pending and t0 + pending[0] <= time.perf_counter():
                admit(f"bench-{n}", t0 + pending.popleft())
                n += 1
            if not engine.has_unfinished():
                time.sleep(max(0.0, t0 + pending[0] - time.perf_counter()))
                continue
        for out in engine.step():
            now = time.perf_counter()
            if out.output_tokens == len(out.new_token_ids):
                ttfts.append((now - started[out.request_id]) * 1000)
            produced += len(out.new_token_ids)
            if out.finish_reason is not None:
                del started[out.request_id]
    return Side(IN_PROCESS, time.perf_counter() - t0, produced, ttfts, len(texts))


async def run_mesh(
    base_url: str,
    model: str,
    texts: list[str],
    output_tokens: int,
    concurrency: int | None = None,
    arrivals: list[float] | None = None,
) -> Side:
    """Closed loop at ``concurrency``, or open loop at the ``arrivals`` times."""
    endpoint = Endpoint(base_url, model, "chat", ignore_eos=True, extra_body={"temperature": 0.0})
    specs = deque(RequestSpec([{"role": "user", "content": q}], output_tokens, 0) for q in texts)
    results: list[RequestResult] = []
    async with new_session() as session:
        t0 = time.perf_counter()

        async def send(spec: RequestSpec, at: float | None = None) -> None:
            result = await send_request(
                session, endpoint, spec, request_id=len(results), run_start=t0, timeout=600,
                scheduled_s=at,
            )  # fmt: skip
            results.append(result)

        async def closed_client() -> None:
            while specs:
                await send(specs.popleft())

        async def arrive(at: float, spec: RequestSpec) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            await send(spec, at)

        if arrivals is None:
            await asyncio.gather(*(closed_client() for _ in range(concurrency or 1)))
        else:
            await asyncio.gather(
                *(arrive(at, spec) for at, spec in zip(arrivals, specs, strict=True))
            )
        seconds = time.perf_counter() - t0
    failed = [r for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} mesh requests failed: {failed[0].error}")
    ttfts = [ttft_from_arrival(r) * 1000 for r in results if r.ttft_s is not None]
    produced = sum(r.output_tokens or 0 for r in results)
    return Side(MESH, seconds, produced, ttfts, len(texts))


def ttft_from_arrival(r: RequestResult) -> float:
    """From the scheduled arrival in the open loop, as on the in-process side: a client sent
    late (its event loop busy) counts its lateness, which it would otherwise not."""
    assert r.ttft_s is not None
    late = r.start_s - r.scheduled_s if r.scheduled_s is not None else 0.0
    return late + r.ttft_s


def median_side(sides: list[Side]) -> Side:
    """The round with the median throughput (the lower middle one of an even count)."""
    ranked = sorted(sides, key=lambda s: s.tokens_per_s)
    return ranked[(len(ranked) - 1) // 2]


def median_ttft(sides: list[Side], q: float) -> float:
    return statistics.median(side.ttft(q) for side in sides)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.mesh", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64, help="per round and workload")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="turns of each side")
    parser.add_argument(
        "--rate-fraction",
        type=float,
        default=0.5,
        help="open-loop arrival rate, as a fraction of the in-process closed-loop request rate",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args(argv)
    # The engine each executor of ``meshserve up`` builds (its defaults: ``--quantization
    # auto`` reads a GGUF model's own blocks), and ``up``'s flags for the mesh side, so both
    # sides run one engine.
    built = up_engine(args.model)
    folder, tokenizer, engine, up_args = built.folder, built.tokenizer, built.engine, built.up
    up_args.model, up_args.port, up_args.served_model_name = str(folder), args.port, "bench"
    mesh = LocalMesh(up_args, folder)
    url, c, out_tokens = mesh.base_url, args.concurrency, args.output_tokens
    closed: dict[str, list[Side]] = {IN_PROCESS: [], MESH: []}
    opened: dict[str, list[Side]] = {IN_PROCESS: [], MESH: []}
    try:
        mesh.start()
        mesh.wait_ready(600)
        warm = warmup_questions(c)
        run_in_process(tokenizer, engine, warm, WARMUP_TOKENS, concurrency=c)
        asyncio.run(run_mesh(url, "bench", warm, WARMUP_TOKENS, concurrency=c))
        for r in range(args.rounds):
            timed = questions(args.requests, r)
            closed[IN_PROCESS].append(run_in_process(tokenizer, engine, timed, out_tokens, c))
            closed[MESH].append(asyncio.run(run_mesh(url, "bench", timed, out_tokens, c)))
        rate = args.rate_fraction * median_side(closed[IN_PROCESS]).requests_per_s
        for r in range(args.rounds):
            timed = questions(args.requests, r, "open")
            at = poisson_arrivals(args.requests, rate, args.seed + r)
            opened[IN_PROCESS].append(
                run_in_process(tokenizer, engine, timed, out_tokens, arrivals=at)
            )
            opened[MESH].append(asyncio.run(run_mesh(url, "bench", timed, out_tokens, None, at)))
    finally:
        mesh.stop()
    weights = f"--quantization {up_args.quantization}, KV {up_args.kv_cache_dtype}"
    report(args, f"{folder.name} ({weights}, as meshserve up)", closed, opened, rate)


def report(
    args: argparse.Namespace,
    model: str,
    closed: dict[str, list[Side]],
    opened: dict[str, list[Side]],
    rate: float,
) -> None:
    print(
        f"\nmodel {model}, CPU, {args.requests} requests per round and workload, "
        f"{args.output_tokens} output tokens each, {args.rounds} rounds; closed loop: "
        f"concurrency {args.concurrency}; open loop: Poisson arrivals at {rate:.2f} req/s "
        f"({args.rate_fraction:.0%} of the in-process closed-loop rate)\n"
    )
    print("| workload | round | path | seconds | output tokens/s | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for workload, sides in (("closed", closed), ("open", opened)):
        rows = [(str(r + 1), s[r]) for r in range(args.rounds) for s in sides.values()]
        rows += [("median", median_side(s)) for s in sides.values()]
        for label, side in rows:
            print(
                f"| {workload} | {label} | {side.name} | {side.seconds:.2f} | "
                f"{side.tokens_per_s:.1f} | {side.ttft(50):.1f} | {side.ttft(99):.1f} |"
            )
    ratio = median_side(closed[MESH]).tokens_per_s / median_side(closed[IN_PROCESS]).tokens_per_s
    rounds = [
        f"{m.tokens_per_s / i.tokens_per_s:.1%}"
        for i, m in zip(closed[IN_PROCESS], closed[MESH], strict=True)
    ]
    added = [median_ttft(opened[MESH], q) - median_ttft(opened[IN_PROCESS], q) for q in (50, 99)]
    print(
        f"\nclosed loop: mesh throughput / in-process (median rounds): {ratio:.1%} "
        f"(round by round: {', '.join(rounds)})\n"
        f"open loop: TTFT added by the mesh (median over rounds): p50 {added[0]:+.1f} ms, "
        f"p99 {added[1]:+.1f} ms"
    )


if __name__ == "__main__":
    main()
