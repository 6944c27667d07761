"""Speculative decoding through the mesh, as ``meshserve up`` runs it: no speculation, prompt
lookup in the executor, and a draft model in the speculator service, side by side.

    python -m tools.bench.spec_mesh --draft out/draft-smollm2-16l [--prompts 8] [-k 4]
        [--max-tokens 128] [--rounds 2]

Starts one mesh per side (its own nats-server, one executor; the draft side adds the
speculator service with ``--draft-model``), each warmed with the same untimed request. Then
the held-out chat prompts (``tools.distill.chat_prompts``, never seen by ``meshserve
distill``) go one at a time over HTTP with streaming, greedy, in turns: prompt 1 to every side,
prompt 2 to every side, ... for ``--rounds`` rounds, so the machine's drifting load falls on
all sides alike; only the side being timed has work. Per side it prints the output tokens,
tokens/s (output tokens over the requests' summed end-to-end time), TTFT and TPOT p50, and from
the executor's ``/metrics`` (read before and after the timed requests): target forward passes,
output tokens per target pass (the headline), draft tokens verified and accepted, and tokens
per verifying step (emitted after stop cuts). Every side's text is checked against the first
side's. k adapts per sequence, as a served mesh does by default.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.nats_server import free_port, free_port_range
from gpu.gguf import resolve_model_path
from loadtest.client import Endpoint, RequestResult, send_request
from loadtest.runner import new_session
from loadtest.workloads import RequestSpec
from services.launcher.mesh import LocalMesh
from services.launcher.up import add_up
from tools.bench.scrape import metric_sums
from tools.distill.chat_prompts import held_out_prompts

MODEL_NAME = "bench"
COUNTERS = (
    "engine_forward_passes",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_emitted_tokens",
)


@dataclass
class Side:
    name: str
    mesh: LocalMesh
    results: list[RequestResult] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)  # deltas over the timed requests

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / sum(r.e2e_s or 0.0 for r in self.results)

    def p50_ms(self, values: list[float]) -> float:
        return statistics.median(values) * 1000 if values else float("nan")


def executor_counters(mesh: LocalMesh) -> dict[str, float]:
    sums = metric_sums(mesh.metrics_urls["executor-0"])
    return {c: sums.get(f"meshserve:{c}_total", 0.0) for c in COUNTERS}


def start_side(name: str, folder: Path, flags: list[str]) -> Side:
    parser = argparse.ArgumentParser()
    add_up(parser.add_subparsers())
    argv = ["up", "--model", str(folder), "--port", str(free_port())]
    argv += ["--served-model-name", MODEL_NAME, "--metrics-port", str(free_port_range(16))]
    mesh = LocalMesh(parser.parse_args([*argv, *flags]), folder)
    side = Side(name, mesh)
    mesh.start()
    return side


async def ask(side: Side, prompt: str, max_tokens: int) -> RequestResult:
    endpoint = Endpoint(
        side.mesh.base_url + "/v1", MODEL_NAME, "chat", extra_body={"temperature": 0.0}
    )
    spec = RequestSpec([{"role": "user", "content": prompt}], max_tokens, 0)
    async with new_session() as session:
        result = await send_request(
            session, endpoint, spec, request_id=0, run_start=0.0, timeout=600
        )
    if not result.success:
        raise RuntimeError(f"{side.name}: {result.error_kind} {result.error}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.spec_mesh", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default=None, help="target: HF folder or .gguf (SmolLM2)")
    parser.add_argument("--draft", type=Path, default=None, help="draft model folder")
    parser.add_argument("-k", type=int, default=4, help="draft tokens per step (max)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts (<= 16)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="turns through the prompts")
    parser.add_argument("--no-ngram", action="store_true", help="skip the prompt-lookup side")
    args = parser.parse_args(argv)
    folder = resolve_model_path(args.model)
    k = ["--num-speculative-tokens", str(args.k)]
    plans: list[tuple[str, list[str]]] = [("no speculation", [])]
    if not args.no_ngram:
        plans.append((f"prompt lookup (executor), k={args.k}", ["--speculator", "ngram", *k]))
    if args.draft is not None:
        plans.append(
            (
                f"draft model (speculator service), k={args.k}",
                ["--draft-model", str(args.draft), *k],
            )
        )
    sides: list[Side] = []
    try:
        for name, flags in plans:
            sides.append(start_side(name, folder, flags))
        for side in sides:
            side.mesh.wait_ready(900)
            asyncio.run(ask(side, "Say hello to the warm-up guest.", 16))
        before = {side.name: executor_counters(side.mesh) for side in sides}
        prompts = held_out_prompts(args.prompts)
        for _ in range(args.rounds):
            for prompt in prompts:
                for side in sides:
                    side.results.append(asyncio.run(ask(side, prompt, args.max_tokens)))
        for side in sides:
            after = executor_counters(side.mesh)
            side.counters = {c: after[c] - before[side.name][c] for c in COUNTERS}
    finally:
        for side in sides:
            side.mesh.stop()
    report(args, folder.name, sides)


def report(args: argparse.Namespace, model: str, sides: list[Side]) -> None:
    base = sides[0]
    out = sys.stdout
    out.write(
        f"\ntarget {model}, draft {args.draft or 'none'}, CPU fp32, one executor per mesh, "
        f"{args.prompts} held-out chat prompts x {args.rounds} rounds, one request at a time, "
        f"greedy, max {args.max_tokens} tokens, adaptive k (max {args.k})\n\n"
    )
    out.write(
        "| side | output tokens | tokens/s | speed-up | TTFT p50 ms | TPOT p50 ms "
        "| target passes | tokens/target pass | drafted | accepted | acceptance "
        "| tokens/verify step | same text |\n"
    )
    out.write("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    base_texts = [r.output_text for r in base.results]
    for s in sides:
        c = s.counters
        passes, drafted, accepted = (
            c["engine_forward_passes"],
            c["spec_decode_num_draft_tokens"],
            c["spec_decode_num_accepted_tokens"],
        )
        drafts, emitted = c["spec_decode_num_drafts"], c["spec_decode_num_emitted_tokens"]
        ttft = s.p50_ms([r.ttft_s for r in s.results if r.ttft_s is not None])
        tpots = [
            ((r.e2e_s or 0.0) - r.ttft_s) / (r.output_tokens - 1)
            for r in s.results
            if r.ttft_s is not None and r.output_tokens > 1
        ]
        same = [r.output_text for r in s.results] == base_texts
        out.write(
            f"| {s.name} | {s.output_tokens} | {s.tokens_per_s:.2f} | "
            f"{s.tokens_per_s / base.tokens_per_s:.2f}x | {ttft:.0f} | {s.p50_ms(tpots):.1f} | "
            f"{passes:.0f} | {s.output_tokens / passes:.3f} | {drafted:.0f} | {accepted:.0f} | "
            f"{accepted / drafted if drafted else 0:.3f} | "
            f"{emitted / drafts if drafts else 1:.3f} | {'yes' if same else 'NO'} |\n"
        )


if __name__ == "__main__":
    main()
