"""Disaggregated prefill/decode against mixed executors, in one run on the same cores.

    python -m tools.bench.disagg [--model PATH] [--streams 6] [--long-every 12] \\
        [--long-tokens 1100] [--window 60] [--rounds 2] [--chunk-tokens 512] \\
        [--local-prefill-below 0]

Two meshes run side by side (each ``meshserve up`` as its processes; every executor one
thread, ``OMP_NUM_THREADS=1``): ``mixed`` with ``--executors 2`` and ``disagg`` with
``--prefill-executors 1 --decode-executors 1``. They take turns: in each window of
``--window`` seconds one mesh serves while the other idles, ``--rounds`` times each, so a
shared machine's drifting load falls on both alike. The workload of a window: ``--streams``
clients that each stream one completion after another (a short prompt, ``--stream-tokens``
tokens, ignore_eos), and every ``--long-every`` seconds one long prompt (``--long-tokens``
words of fresh text, so no prefix cache helps; ``--long-output`` tokens).

Printed per layout (pooled over its windows): ITL p50/p99/p99.9/max and TPOT (mean) of the
streams (a long prompt stalls only the streams that share its executor, for a few steps, so
where those stalls are under 1% of the gaps only p99.9 and the maximum see them),
TTFT p50/p99 of the long prompts, output throughput (every token of both kinds / window
time), and for ``disagg`` the KV transfer bandwidth (bytes / time of the prefill executor's
transfers, from its metrics) against this machine's memcpy bandwidth (numpy, one thread: a
transfer is one thread's copy too), measured twice: after the windows on a buffer of the mean
transfer's size (an idle machine), and during every window halfway between long prompts, 64 MB,
while the streams decode (the memory bus as the transfers find it; both layouts alike).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from common.nats_server import free_port, free_port_range
from gpu.gguf import resolve_model_path
from loadtest.client import Endpoint, RequestResult, send_request
from loadtest.runner import new_session
from loadtest.workloads import RequestSpec
from services.launcher.console import ServiceLogs
from services.launcher.mesh import LocalMesh
from services.launcher.up import add_up
from tools.bench.scrape import metric_sums

LAYOUTS = {
    "mixed": {"executors": 2, "prefill_executors": 0, "decode_executors": 0},
    "disagg": {"executors": 0, "prefill_executors": 1, "decode_executors": 1},
}
# Common words, so a long prompt tokenizes to about one token per word.
WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by",
         "at", "from", "his", "it", "an", "were", "are", "which")  # fmt: skip


@dataclass
class Tally:
    itl_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    long_ttft_ms: list[float] = field(default_factory=list)
    long_prompt_tokens: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    failed: int = 0
    kv_bytes: float = 0.0
    kv_seconds: float = 0.0
    kv_transfers: float = 0.0
    # memcpy GB/s sampled in the bench process while the mesh serves (between long prompts)
    memcpy_gb_s: list[float] = field(default_factory=list)

    def add_stream(self, r: RequestResult) -> None:
        if not r.success:
            self.failed += 1
            return
        self.tokens += r.output_tokens
        self.itl_ms += [s * 1000 for s in r.itl_s]
        if r.output_tokens > 1 and r.e2e_s is not None and r.ttft_s is not None:
            self.tpot_ms.append((r.e2e_s - r.ttft_s) * 1000 / (r.output_tokens - 1))

    def add_long(self, r: RequestResult) -> None:
        if not r.success or r.ttft_s is None:
            self.failed += 1
            return
        self.tokens += r.output_tokens
        self.long_ttft_ms.append(r.ttft_s * 1000)
        if r.prompt_tokens is not None:
            self.long_prompt_tokens.append(r.prompt_tokens)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q))


def long_prompt(rng: random.Random, words: int) -> str:
    # A unique head (numbers) so no two long prompts share a cached page.
    head = " ".join(str(rng.randrange(10**6)) for _ in range(8))
    return head + " " + " ".join(rng.choice(WORDS) for _ in range(words))


async def window(url: str, args: argparse.Namespace, seed: int) -> tuple[Tally, float]:
    rng = random.Random(seed)
    endpoint = Endpoint(url, "bench", kind="completions", ignore_eos=True)
    tally = Tally()
    start = time.perf_counter()
    stop_at = start + args.window
    ids = iter(range(10**9))

    async def stream(session: aiohttp.ClientSession, i: int) -> None:
        while time.perf_counter() < stop_at:
            spec = RequestSpec([{"role": "user", "content": f"Stream {i}: tell a story."}],
                               args.stream_tokens, 12)  # fmt: skip
            r = await send_request(session, endpoint, spec, request_id=next(ids),
                                   run_start=start, timeout=600)  # fmt: skip
            tally.add_stream(r)

    async def longs(session: aiohttp.ClientSession) -> None:
        pending = []
        await asyncio.sleep(args.long_every / 2)
        while time.perf_counter() < stop_at - 1:
            spec = RequestSpec([{"role": "user", "content": long_prompt(rng, args.long_tokens)}],
                               args.long_output, args.long_tokens)  # fmt: skip
            coro = send_request(session, endpoint, spec, request_id=next(ids),
                                run_start=start, timeout=600)  # fmt: skip
            pending.append(asyncio.ensure_future(coro))
            await asyncio.sleep(args.long_every)
        for r in await asyncio.gather(*pending):
            tally.add_long(r)

    async def memcpy_samples() -> None:
        # Halfway between long prompts (no transfer then), while the streams decode: what a
        # copy gets from the memory bus the transfers share with the decode steps.
        await asyncio.sleep(args.long_every)
        while time.perf_counter() < stop_at - 1:
            sample = await asyncio.to_thread(memcpy_gb_s, MEMCPY_BYTES, 3)
            tally.memcpy_gb_s.append(sample)
            await asyncio.sleep(args.long_every)

    async with new_session() as session:
        await asyncio.gather(
            longs(session), memcpy_samples(), *(stream(session, i) for i in range(args.streams))
        )
    tally.seconds = time.perf_counter() - start
    return tally, tally.seconds


def kv_counters(mesh: LocalMesh) -> tuple[float, float, float]:
    url = mesh.metrics_urls.get("prefill-0")
    if url is None:
        return 0.0, 0.0, 0.0
    sums = metric_sums(url)  # no series before the first transfer: 0
    return (
        sums.get("meshserve:kv_transfer_bytes_total", 0.0),
        sums.get("meshserve:kv_transfer_time_seconds_sum", 0.0),
        sums.get("meshserve:kv_transfer_time_seconds_count", 0.0),
    )


MEMCPY_BYTES = 64 << 20  # past the caches, about a 1,152-token prompt's KV


def memcpy_gb_s(nbytes: int, tries: int = 7) -> float:
    src = np.ones(max(nbytes, 1 << 20), dtype=np.uint8)
    dst = np.ones_like(src)  # written, so no page fault falls inside the timing
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return src.nbytes / best / 1e9


def start_mesh(name: str, args: argparse.Namespace, folder: Path, metrics_port: int) -> LocalMesh:
    parser = argparse.ArgumentParser()
    add_up(parser.add_subparsers())
    layout = LAYOUTS[name]
    up = parser.parse_args(["up", "--model", str(folder), "--served-model-name", "bench"])
    up.port, up.metrics_port, up.router = free_port(), metrics_port, "kv"
    for key, value in layout.items():
        setattr(up, key, value)
    up.kv_transfer_timeout = 120.0
    up.max_num_batched_tokens = args.chunk_tokens
    logs = ServiceLogs(Path(args.out_dir) / f"{name}-logs", 30)
    mesh = LocalMesh(up, folder, logs=logs)
    mesh.start()
    mesh.wait_ready(900)
    return mesh


def report(name: str, t: Tally, memcpy: float | None) -> list[str]:
    rows = [
        f"{name:7s} ITL p50 {pct(t.itl_ms, 50):8.1f} ms  p99 {pct(t.itl_ms, 99):8.1f} ms  "
        f"p99.9 {pct(t.itl_ms, 99.9):8.1f} ms  max {max(t.itl_ms, default=float('nan')):8.1f} ms "
        f"({len(t.itl_ms)} gaps)  "
        f"TPOT {statistics.fmean(t.tpot_ms) if t.tpot_ms else float('nan'):7.1f} ms  "
        f"long TTFT p50 {pct(t.long_ttft_ms, 50):8.0f} ms  p99 {pct(t.long_ttft_ms, 99):8.0f} ms  "
        f"out {t.tokens / t.seconds:6.1f} tok/s  long prompts {len(t.long_ttft_ms)}  "
        f"(>= {min(t.long_prompt_tokens, default=0)} tokens)  failed {t.failed}"
    ]
    if t.kv_transfers:
        bw = t.kv_bytes / t.kv_seconds / 1e9
        rows.append(
            f"        KV transfers {t.kv_transfers:.0f}, "
            f"{t.kv_bytes / t.kv_transfers / 1e6:.1f} MB each, {bw:.2f} GB/s; "
            f"memcpy after the windows {memcpy:.2f} GB/s ({bw / (memcpy or 1) * 100:.0f}%)"
        )
    if t.memcpy_gb_s:
        during = statistics.median(t.memcpy_gb_s)
        line = (
            f"        memcpy of 64 MB during the windows, median of {len(t.memcpy_gb_s)}: "
            f"{during:.2f} GB/s (range {min(t.memcpy_gb_s):.2f}-{max(t.memcpy_gb_s):.2f})"
        )
        if t.kv_transfers:
            line += f"; KV transfers at {bw / during * 100:.0f}% of it"
        rows.append(line)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench.disagg", description=__doc__)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2)")
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--stream-tokens", type=int, default=48)
    p.add_argument("--long-every", type=float, default=12.0,
                   help="seconds between long prompts (their arrival interval)")  # fmt: skip
    p.add_argument("--long-tokens", type=int, default=1100, help="words of a long prompt")
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-dir", default="out/bench_disagg")
    p.add_argument(
        "--chunk-tokens", type=int, default=512,
        help="every executor's step token budget (--max-num-batched-tokens): a long prompt's "
        "prefill chunk",
    )  # fmt: skip
    p.add_argument(
        "--local-prefill-below", type=int, default=0,
        help="disagg: prompts with fewer uncached tokens are prefilled on the decode executor "
        "(the scheduler's --disagg-min-prompt-tokens; 0: every prompt moves)",
    )  # fmt: skip
    args = p.parse_args(argv)
    # The scheduler of each mesh reads it from the environment (the mixed one has no pairs).
    os.environ["MESHSERVE_DISAGG_MIN_PROMPT_TOKENS"] = str(args.local_prefill_below)
    os.environ["OMP_NUM_THREADS"] = "1"  # each executor one thread (children inherit it)
    # Both layouts' executors at the same priority as everything else on the machine: the
    # default niceness (10) starves them on a machine other jobs keep busy.
    os.environ["MESHSERVE_ENGINE_NICE"] = "0"
    folder = resolve_model_path(args.model)
    meshes = {}
    try:
        for name in LAYOUTS:
            meshes[name] = start_mesh(name, args, folder, free_port_range(10))
        print("meshes up; warming up", flush=True)
        for mesh in meshes.values():  # untimed: first forward passes, NIXL connections
            asyncio.run(window(mesh.base_url + "/v1", argparse.Namespace(
                **{**vars(args), "window": 8.0, "long_every": 4.0}), seed=999))  # fmt: skip
        tallies = {name: Tally() for name in LAYOUTS}
        for r in range(args.rounds):
            for name, mesh in meshes.items():
                before = kv_counters(mesh)
                t, _ = asyncio.run(window(mesh.base_url + "/v1", args, seed=r))
                after = kv_counters(mesh)
                total = tallies[name]
                total.itl_ms += t.itl_ms
                total.tpot_ms += t.tpot_ms
                total.long_ttft_ms += t.long_ttft_ms
                total.long_prompt_tokens += t.long_prompt_tokens
                total.tokens += t.tokens
                total.seconds += t.seconds
                total.failed += t.failed
                total.kv_bytes += after[0] - before[0]
                total.kv_seconds += after[1] - before[1]
                total.kv_transfers += after[2] - before[2]
                total.memcpy_gb_s += t.memcpy_gb_s
                print(*report(f"{name}#{r}", t, None)[:1], flush=True)
    finally:
        for mesh in meshes.values():
            mesh.stop()
    d = tallies["disagg"]
    memcpy = memcpy_gb_s(int(d.kv_bytes / d.kv_transfers)) if d.kv_transfers else None
    print(f"memcpy of 64 MB (past the caches): {memcpy_gb_s(MEMCPY_BYTES):.2f} GB/s")
    print(f"\n{args.rounds} windows of {args.window:.0f} s per layout, {args.streams} streams")
    for name, t in tallies.items():
        print("\n".join(report(name, t, memcpy)))
    m = tallies["mixed"]
    ratios = ", ".join(
        f"p{q:g} {pct(m.itl_ms, q) / pct(d.itl_ms, q):.2f}x" for q in (50, 99, 99.9, 100)
    )
    print(
        f"ITL mixed/disagg: {ratios}; throughput "
        f"disagg/mixed {(d.tokens / d.seconds) / (m.tokens / m.seconds):.2f}"
    )


if __name__ == "__main__":
    main()
