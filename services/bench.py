"""The same concurrent workload through the whole mesh and through the in-process engine.

    python -m services.bench [--model PATH] [--concurrency 16] [--requests 64] [--output-tokens 64]

Both sides get the same chat prompts, the same engine settings, greedy decoding and exactly
``--output-tokens`` tokens per request (ignore_eos), closed loop at ``--concurrency``. The mesh
runs as ``meshserve up`` would (nats-server plus one process per service) and is driven over
HTTP with streaming; the in-process side calls ``Engine.step()`` directly. Printed: throughput,
TTFT p50/p99 of each, the throughput ratio and the TTFT the mesh adds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import deque
from dataclasses import dataclass

from common.tokenizer import Tokenizer
from gpu.bench import QUESTIONS
from gpu.engine import Engine, EngineConfig
from gpu.gguf import resolve_model_path
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling import SamplingParams
from loadtest.client import Endpoint, RequestResult, send_request
from loadtest.runner import new_session
from loadtest.workloads import RequestSpec
from services.up import LocalMesh, add_up


@dataclass(frozen=True)
class Side:
    name: str
    seconds: float
    output_tokens: int
    ttfts_ms: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def ttft(self, q: float) -> float:
        return statistics.quantiles(self.ttfts_ms, n=100)[int(q) - 1]


def questions(n: int) -> list[str]:
    return [f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})" for i in range(n)]


def run_in_process(args: argparse.Namespace, tokenizer: Tokenizer, engine: Engine) -> Side:
    prompts = deque(
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}]),
            add_special_tokens=False,
        )
        for q in questions(args.requests)
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    started: dict[str, float] = {}
    ttfts: list[float] = []
    produced = 0
    t0 = time.perf_counter()
    n = 0
    while prompts or engine.has_unfinished():
        while prompts and len(started) < args.concurrency:
            rid = f"bench-{n}"
            n += 1
            engine.add_request(rid, prompts.popleft(), params)
            started[rid] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            if out.output_tokens == len(out.new_token_ids):
                ttfts.append((now - started[out.request_id]) * 1000)
            produced += len(out.new_token_ids)
            if out.finish_reason is not None:
                del started[out.request_id]
    engine.blocks.reset_prefix_cache()
    return Side("in-process engine", time.perf_counter() - t0, produced, ttfts)


async def run_mesh(args: argparse.Namespace, base_url: str, model: str) -> Side:
    endpoint = Endpoint(base_url, model, "chat", ignore_eos=True)
    specs = deque(
        RequestSpec([{"role": "user", "content": q}], args.output_tokens, 0)
        for q in questions(args.requests)
    )
    results: list[RequestResult] = []
    async with new_session() as session:
        t0 = time.perf_counter()

        async def worker() -> None:
            while specs:
                spec = specs.popleft()
                results.append(
                    await send_request(
                        session, endpoint, spec, request_id=len(results), run_start=t0, timeout=600
                    )
                )

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        seconds = time.perf_counter() - t0
    failed = [r for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} mesh requests failed: {failed[0].error}")
    ttfts = [r.ttft_s * 1000 for r in results if r.ttft_s is not None]
    return Side("mesh (HTTP/SSE, NATS)", seconds, sum(r.output_tokens or 0 for r in results), ttfts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers()
    add_up(sub)  # reuse meshserve up's flags for the mesh side
    up_args = sub.choices["up"].parse_args([])
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args(argv)
    folder = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    config = EngineConfig(up_args.max_num_batched_tokens, up_args.max_num_seqs)
    pages = up_args.kv_cache_tokens // up_args.page_size
    engine = Engine(
        ModelRunner(load_model(folder), pages, up_args.page_size), config, tokenizer.eos_token_ids
    )
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    local = run_in_process(args, tokenizer, engine)
    del engine
    up_args.model, up_args.port, up_args.served_model_name = str(folder), args.port, "bench"
    mesh = LocalMesh(up_args, folder)
    try:
        mesh.start()
        mesh.wait_ready(600)
        remote = asyncio.run(run_mesh(args, mesh.base_url, "bench"))
    finally:
        mesh.stop()
    print(
        f"\nmodel {folder.name}, CPU fp32, {args.requests} requests, concurrency "
        f"{args.concurrency}, {args.output_tokens} output tokens each\n"
    )
    print("| path | seconds | output tokens/s | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|")
    for side in (local, remote):
        print(
            f"| {side.name} | {side.seconds:.2f} | {side.tokens_per_s:.1f} | "
            f"{side.ttft(50):.1f} | {side.ttft(99):.1f} |"
        )
    print(
        f"\nmesh throughput / in-process: {remote.tokens_per_s / local.tokens_per_s:.1%}; "
        f"TTFT added by the mesh at p50: {remote.ttft(50) - local.ttft(50):+.1f} ms"
    )


if __name__ == "__main__":
    main()
