"""Decode speed of one replica split over 2 ranks against the unsplit one, on this machine.

    python -m tools.bench.tensor_parallel [--rounds 3] [--steps 48] [--batches 1,16]
        [--quantization none] [--threads 2] [--device cpu|cuda]

TP=1 runs with ``--threads`` threads; TP=2 with ``--threads / 2`` per rank (rank 0 in this
process, rank 1 a child), so both sides use the same cores. Both replicas are built once, in
this process, and take turns: per round and batch size, each decodes ``--steps`` steps of the
same requests (after an untimed prefill and warm-up); the table shows each side's median
round: decode tokens/s, time per step, and (TP=2) the time rank 0 spent in collectives per
step (the all-reduces, the logits gather and the step broadcast, waits for the other rank
included) and their number. TP=2 runs twice: all-reduces through shared memory (the
default on CPU) and through Gloo alone (``shared_memory=False``), to show what the former
buys.

Model: the default model (SmolLM2-135M) cannot be split 2 ways (9 query and 3 KV heads), so
the benchmark writes a random Llama of its shape with 12 query and 4 KV heads (head_dim 48;
hidden 576, 30 layers, MLP 1536, vocabulary 49152, tied embeddings: 135M parameters). Speed
does not depend on the weights' values.

``--device cuda`` (a host with two GPUs: TP=1 on cuda:0, TP=2 on cuda:0 and cuda:1 over
NCCL, bf16) is what the GPU check runs where it finds two devices; with fewer it says so and
exits.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpu.engine import Engine, EngineConfig
from gpu.replica import build_runner
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams

SHAPE: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1,
    eos_token_id=2,
)  # fmt: skip


def write_model(folder: Path) -> Path:
    """Random weights of ``SHAPE`` (safetensors only: the GPU machine has no transformers)."""
    from tools.gpu_check.check_model import write_synthetic_model

    return write_synthetic_model(folder, {"model_type": "llama", **SHAPE})


@dataclass
class Round:
    tokens_per_s: float
    step_ms: float
    comm_ms: float
    collectives: float


STEP_BUDGET = 2048


def decode_round(runner: ModelRunner, threads: int, batch: int, steps: int) -> Round:
    torch.set_num_threads(threads)
    engine = Engine(runner, EngineConfig(max_num_batched_tokens=STEP_BUDGET, max_num_seqs=batch))
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [3 + (i * 7 + j) % 1000 for j in range(32)], params)
    for _ in range(4):  # the prefill and a few decode steps, untimed
        engine.step()
    tp = runner.model.tp
    comm0, n0 = (tp.comm_ns, tp.num_collectives) if tp is not None else (0, 0)
    start = time.perf_counter()
    emitted = 0
    for _ in range(steps):
        emitted += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - start
    for i in range(batch):
        engine.abort(str(i))
    comm = (tp.comm_ns - comm0) / 1e6 if tp is not None else 0.0
    calls = (tp.num_collectives - n0) if tp is not None else 0
    return Round(emitted / seconds, seconds / steps * 1e3, comm / steps, calls / steps)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--quantization", default="none")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", type=Path, default=None, help="a model folder (default: written)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and torch.cuda.device_count() < 2:
        print(f"TP=2 on CUDA needs 2 GPUs; this machine has {torch.cuda.device_count()}")
        return
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or write_model(Path(tmp) / "llama-135m-12h")
        pages: dict[str, Any] = dict(num_pages=max(batches) * 8, page_size=16)
        pages["device"] = args.device
        pages["max_num_batched_tokens"] = STEP_BUDGET  # the other ranks' warm-up covers it
        one = build_runner(folder, quantization=args.quantization, progress=False, **pages)
        torch.set_num_threads(args.threads)  # build_runner gives each rank its share
        two = build_runner(
            folder, quantization=args.quantization, progress=False, tensor_parallel_size=2,
            **pages,
        )  # fmt: skip
        half = args.threads // 2
        sides = [("TP=1", one, args.threads), ("TP=2", two, half)]
        gloo = None
        if not cuda:  # NCCL is the only CUDA path
            torch.set_num_threads(args.threads)
            gloo = build_runner(
                folder, quantization=args.quantization, progress=False, tensor_parallel_size=2,
                shared_memory=False, **pages,
            )  # fmt: skip
            sides.append(("TP=2 Gloo", gloo, half))
        try:
            results: dict[tuple[str, int], list[Round]] = {}
            for _, runner, threads in sides:  # warm-up, untimed
                decode_round(runner, threads, max(batches), 4)
            for _ in range(args.rounds):
                for batch in batches:
                    for name, runner, threads in sides:
                        r = decode_round(runner, threads, batch, args.steps)
                        results.setdefault((name, batch), []).append(r)
        finally:
            two.close()
            if gloo is not None:
                gloo.close()
    print(
        f"\nquantization {args.quantization}, {args.rounds} rounds x {args.steps} steps, median "
        f"round; TP=1 {args.threads} threads, TP=2 {args.threads // 2} per rank\n"
    )
    print("| batch | side | decode tokens/s | ms per step | collectives ms per step "
          "(rank 0) | collectives per step |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for batch in batches:
        for name, _, _ in sides:
            rounds = results[(name, batch)]
            tok = statistics.median(r.tokens_per_s for r in rounds)
            step = statistics.median(r.step_ms for r in rounds)
            comm = statistics.median(r.comm_ms for r in rounds)
            calls = statistics.median(r.collectives for r in rounds)
            extra = f"{comm:.2f} | {calls:.0f}" if name != "TP=1" else "- | -"
            print(f"| {batch} | {name} | {tok:.1f} | {step:.2f} | {extra} |")


if __name__ == "__main__":
    main()
