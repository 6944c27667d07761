"""Cache-aware routing against round-robin on the shared-prefix workload, in one run.

For each router policy in turn: start ``meshserve up --executors E --router P
--kv-cache-tokens N`` (each executor's KV pool holds only part of the system prompts), send
every system prompt once (the prompts a deployment already serves), run ``python -m loadtest
run --workload shared-prefix`` against it, stop it. Then print one table: prefix-cache hit rate
(cached / prompt tokens, from each response's ``usage.prompt_tokens_details.cached_tokens``),
TTFT p50/p99, throughput, and the ratios against the first policy::

    python -m tools.bench.routing --kv-cache-tokens 2560 --num-prefixes 8 --prefix-len 512 \\
        --num-requests 150 --concurrency 8

Both meshes run the same seed, so they see the same requests in the same order. With
``--rounds R`` the policies take turns R times (A B A B, each on a fresh mesh warmed the same
way), and the table shows each policy's round with the median output throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from common.nats_server import free_port
from loadtest.results import load_runs
from loadtest.table import fmt, format_table, get
from loadtest.workloads import LengthDist, SharedPrefixWorkload

MODEL_NAME = "bench"

ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("prefix cache hit rate", ("prefix_cache_hit_rate",)),
    ("TTFT p50 (ms)", ("ttft_ms", "p50")),
    ("TTFT p99 (ms)", ("ttft_ms", "p99")),
    ("E2E p50 (ms)", ("e2e_ms", "p50")),
    ("request throughput (req/s)", ("request_throughput",)),
    ("output throughput (tok/s)", ("output_token_throughput",)),
    ("requests completed", ("completed",)),
    ("requests failed", ("failed",)),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.bench.routing", description=__doc__)
    p.add_argument("--routers", default="round-robin,kv", help="policies, first is the baseline")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2)")
    p.add_argument("--executors", type=int, default=2)
    p.add_argument("--kv-cache-tokens", type=int, default=2560, help="per executor")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", default="16")
    p.add_argument("--output-len", default="16")
    p.add_argument("--num-requests", type=int, default=150)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, s")
    p.add_argument("--rounds", type=int, default=1, help="turns of each policy")
    p.add_argument("--out-dir", default="out/bench_routing")
    return p


class Mesh:
    """``meshserve up`` in its own process group; ``stop`` is Ctrl-C to all of it."""

    def __init__(self, args: argparse.Namespace, router: str, log: Path) -> None:
        self.port = free_port()
        cmd = [
            sys.executable, "-m", "services.launcher", "up",
            "--executors", str(args.executors),
            "--router", router,
            "--kv-cache-tokens", str(args.kv_cache_tokens),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--port", str(self.port),
            "--served-model-name", MODEL_NAME,
            "--log-dir", str(log.parent / f"{router}-logs"),  # each service's <name>.log
        ]  # fmt: skip
        if args.model:
            cmd += ["--model", args.model]
        print("$", " ".join(cmd[2:]), flush=True)
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "is up" in line:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"meshserve up exited with {self.proc.returncode}")
        raise TimeoutError("meshserve up did not come up")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def warm_up(base_url: str, args: argparse.Namespace) -> None:
    """Serve every system prompt once, as a deployment would have before the measurement."""
    workload = SharedPrefixWorkload(
        args.num_prefixes,
        args.prefix_len,
        LengthDist.parse(args.suffix_len),
        LengthDist.parse(args.output_len),
        seed=args.seed,
    )
    for g, prefix in enumerate(workload.prefixes):
        body = {
            "model": MODEL_NAME,
            "messages": [
                {"role": "system", "content": prefix},
                {"role": "user", "content": f"Warm-up {g}."},
            ],
            "max_tokens": 1,
        }
        req = urllib.request.Request(
            base_url + "/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            resp.read()


def run_load(base_url: str, args: argparse.Namespace, out: Path) -> None:
    cmd = [
        sys.executable, "-m", "loadtest", "run",
        "--base-url", base_url,
        "--model", MODEL_NAME,
        "--endpoint", "chat",
        "--workload", "shared-prefix",
        "--num-prefixes", str(args.num_prefixes),
        "--prefix-len", str(args.prefix_len),
        "--suffix-len", args.suffix_len,
        "--output-len", args.output_len,
        "--ignore-eos",
        "--concurrency", str(args.concurrency),
        "--num-requests", str(args.num_requests),
        "--seed", str(args.seed),
        "--timeout", str(args.timeout),
        "--no-progress",
        "--out", str(out),
    ]  # fmt: skip
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def comparison(summaries: dict[str, dict[str, Any]]) -> str:
    names = list(summaries)
    base = summaries[names[0]]
    headers = ["metric", *names, *(f"{n} / {names[0]}" for n in names[1:])]
    rows = []
    for label, path in ROWS:
        values = [get(summaries[n], path) for n in names]
        ratios = []
        for v in values[1:]:
            b = get(base, path)
            ok = isinstance(v, int | float) and isinstance(b, int | float) and b
            ratios.append(f"{v / b:.2f}x" if ok else "-")
        rows.append([label, *(fmt(v) for v in values), *ratios])
    return format_table(headers, rows)


def median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median output throughput (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda s: float(get(s, ("output_token_throughput",)) or 0.0))
    return ordered[(len(ordered) - 1) // 2]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    routers = args.routers.split(",")
    rounds: dict[str, list[dict[str, Any]]] = {router: [] for router in routers}
    for r in range(args.rounds):
        for router in routers:
            mesh = Mesh(args, router, out_dir / f"{router}-{r}.log")
            try:
                mesh.wait_ready()
                started = time.monotonic()
                warm_up(mesh.base_url, args)
                out = out_dir / f"{router}-{r}.json"
                run_load(mesh.base_url, args, out)
                print(f"{router} round {r + 1}: {time.monotonic() - started:.0f} s", flush=True)
            finally:
                mesh.stop()
            rounds[router].append(load_runs(out)[0].summary)
    summaries = {router: median_round(runs) for router, runs in rounds.items()}
    print()
    print(comparison(summaries))
    (out_dir / "summary.txt").write_text(comparison(summaries) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
