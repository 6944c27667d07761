"""The load generator's command line: ``python -m loadtest run|report|compare``."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from loadtest.client import Endpoint
from loadtest.compare import compare_files
from loadtest.results import build_document, run_record, write_document
from loadtest.runner import LoadConfig, new_session, run_load, warmup
from loadtest.stats import parse_slo
from loadtest.table import summary_table
from loadtest.workloads import (
    WORKLOADS,
    LengthDist,
    MultiTurnWorkload,
    SharedPrefixWorkload,
    ShareGPTWorkload,
    SyntheticWorkload,
    Workload,
)

__all__ = ["build_parser", "build_workload", "main"]

_DEFAULT_OUTPUT_LEN = "128"
_DEFAULT_INPUT_LEN = {"synthetic": "512", "multi-turn": "128"}
# The warm-up's workload seed is --seed plus this: prompts no timed run (seed, seed + 1, ... for
# a sweep's rates) shares, so none of them is a prefix-cache hit because of the warm-up.
WARMUP_SEED_OFFSET = 1_000_003


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not > 0")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not >= 1")
    return v


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad rate list {text!r}") from e
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0: {text!r}")
    return rates


def _length(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _json_object(text: str) -> dict[str, Any]:
    try:
        v = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest",
        description="Load generator and report for OpenAI-compatible streaming servers.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a load test and write a JSON result file")
    r.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    r.add_argument("--model", required=True, help="the model id to request")
    r.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    mode = r.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--rate", type=_positive_float, help="open loop: Poisson arrivals per second (inf: all)"
    )
    mode.add_argument("--concurrency", type=_positive_int, help="closed loop: requests in flight")
    mode.add_argument(
        "--sweep",
        type=_rates,
        help="open loop at each rate in turn: R1,R2,... (rate i seeded --seed + i: prompts "
        "of its own)",
    )
    r.add_argument(
        "--num-requests", type=_positive_int, default=200, help="most requests per run (200)"
    )
    r.add_argument(
        "--duration",
        type=_positive_float,
        default=600.0,
        help="no new request after this many seconds of a run (600)",
    )
    r.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    r.add_argument(
        "--input-len",
        type=_length,
        default=None,
        help="prompt tokens, N or LOW:HIGH (synthetic: 512; multi-turn, per user turn: 128)",
    )
    r.add_argument(
        "--output-len",
        type=_length,
        default=None,
        help="max_tokens, N or LOW:HIGH (128; sharegpt: the reference answer's length)",
    )
    r.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos=true and min_tokens=max_tokens (vLLM/SGLang) for exact lengths",
    )
    r.add_argument("--num-prefixes", type=_positive_int, default=4, help="shared-prefix: G (4)")
    r.add_argument(
        "--prefix-len", type=int, default=1024, help="shared-prefix: system prompt tokens (1024)"
    )
    r.add_argument(
        "--suffix-len",
        type=_length,
        default=LengthDist(32, 32),
        help="shared-prefix: question tokens, N or LOW:HIGH (32)",
    )
    r.add_argument("--turns", type=_positive_int, default=4, help="multi-turn: turns (4)")
    r.add_argument("--dataset", help="sharegpt: a ShareGPT-format JSON file")
    r.add_argument(
        "--max-input-len",
        type=_positive_int,
        default=None,
        help="sharegpt: skip prompts longer than this many (approximate) tokens",
    )
    r.add_argument("--slo", help="goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2e=10s")
    r.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    r.add_argument(
        "--timeout", type=_positive_float, default=300.0, help="per-request timeout, s (300)"
    )
    r.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals (0)")
    r.add_argument(
        "--warmup", type=int, default=0, help="untimed requests sent first, of other prompts (0)"
    )
    r.add_argument(
        "--extra-body",
        type=_json_object,
        default=None,
        help="JSON merged into every request body, e.g. '{\"temperature\": 0}'",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--out", required=True, help="the JSON result file to write")

    rep = sub.add_parser("report", help="plots and index.html from result files")
    rep.add_argument("files", nargs="+", help="result JSON files")
    rep.add_argument("--out", required=True, help="output folder")

    c = sub.add_parser("compare", help="two result files side by side, with ratios B/A")
    c.add_argument("a", help="baseline result file (A)")
    c.add_argument("b", help="result file to compare (B)")
    return p


def build_workload(args: argparse.Namespace, seed: int | None = None) -> Workload:
    """The workload named by ``args.workload``: a fresh one, seeded by ``seed`` (default
    ``args.seed``)."""
    name: str = args.workload
    seed = args.seed if seed is None else seed
    out_len: LengthDist = args.output_len or LengthDist.parse(_DEFAULT_OUTPUT_LEN)
    in_len: LengthDist = args.input_len or LengthDist.parse(_DEFAULT_INPUT_LEN.get(name, "512"))
    if name == "synthetic":
        return SyntheticWorkload(in_len, out_len, seed=seed)
    if name == "shared-prefix":
        return SharedPrefixWorkload(
            args.num_prefixes, args.prefix_len, args.suffix_len, out_len, seed=seed
        )
    if name == "multi-turn":
        return MultiTurnWorkload(args.turns, in_len, out_len, seed=seed)
    if name == "sharegpt":
        if not args.dataset:
            raise ValueError("--workload sharegpt needs --dataset FILE")
        return ShareGPTWorkload(
            args.dataset, args.output_len, seed=seed, max_input_tokens=args.max_input_len
        )
    raise ValueError(f"unknown workload {name!r}")


async def _run_all(
    endpoint: Endpoint,
    loads: Sequence[LoadConfig],
    make_workload: Callable[[int], Workload],
    args: argparse.Namespace,
    slo: dict[str, float],
) -> list[dict[str, Any]]:
    records = []
    async with new_session() as session:
        if args.warmup > 0:
            c = loads[0].concurrency or min(args.warmup, 8)
            # Prompts of their own: the timed run's would come from the prefix cache.
            warm = make_workload(args.seed + WARMUP_SEED_OFFSET)
            failed = await warmup(endpoint, warm, args.warmup, c, args.timeout, session=session)
            if failed:
                print(f"warmup: {failed}/{args.warmup} requests failed", file=sys.stderr)
        for load in loads:
            run = await run_load(
                endpoint, make_workload(load.seed), load, progress=not args.no_progress,
                session=session,
            )  # fmt: skip
            records.append(run_record(run, slo))
    return records


def _cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        slo = parse_slo(args.slo)
        workload = build_workload(args)  # fail early on a bad dataset
        endpoint = Endpoint(
            base_url=args.base_url,
            model=args.model,
            kind=args.endpoint,
            api_key=args.api_key or None,
            ignore_eos=args.ignore_eos,
            extra_body=args.extra_body or {},
        )
    except (ValueError, OSError) as e:
        parser.error(str(e))
    common: dict[str, Any] = {
        "num_requests": args.num_requests,
        "duration_s": args.duration,
        "timeout_s": args.timeout,
        "seed": args.seed,
    }
    loads: list[LoadConfig]
    if args.sweep:  # each rate its own prompts (and arrivals): seed, seed + 1, ...
        loads = [
            LoadConfig("rate", rate=rate, **(common | {"seed": args.seed + i}))
            for i, rate in enumerate(args.sweep)
        ]
    elif args.rate is not None:
        loads = [LoadConfig("rate", rate=args.rate, **common)]
    else:
        loads = [LoadConfig("concurrency", concurrency=args.concurrency, **common)]

    def make(seed: int) -> Workload:
        return build_workload(args, seed)

    records = asyncio.run(_run_all(endpoint, loads, make, args, slo))
    config: dict[str, Any] = {
        "base_url": args.base_url,
        "url": endpoint.url,
        "model": args.model,
        "endpoint": args.endpoint,
        "workload": workload.name,
        "workload_params": workload.describe(),
        "ignore_eos": args.ignore_eos,
        "extra_body": args.extra_body or {},
        "slo_ms": slo,
        "warmup": args.warmup,
        "api_key_set": bool(args.api_key),
        **common,
    }
    if args.sweep:
        config["mode"] = "sweep"
        config["rates"] = ["inf" if math.isinf(x) else x for x in args.sweep]
    doc = build_document(config, records, sweep=bool(args.sweep))
    write_document(doc, args.out)
    print(summary_table([(rec["label"], rec["summary"]) for rec in records]))
    print(f"\nwrote {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        return _cmd_run(args, parser)
    if args.command == "report":
        # matplotlib (slow to import): only a report draws, not every run of the load generator.
        from loadtest.report import write_report

        written = write_report(args.files, args.out)
        for path in written:
            print(path)
        return 0
    if args.command == "compare":
        print(compare_files(args.a, args.b))
        return 0
    parser.error(f"unknown command {args.command!r}")


if __name__ == "__main__":
    raise SystemExit(main())
