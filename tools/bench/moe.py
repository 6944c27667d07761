"""A mixture-of-experts model through the engine, against its dense twin and transformers.

    python -m tools.bench.moe [--concurrency 16] [--output-tokens 48] [--rounds 3]
        [--hf-requests 4] [--quantization none|int8|int4]

Writes two random models of one shape with SmolLM2's tokenizer and vocabulary (hidden 576,
9 query and 3 KV heads, 12 layers, tied embeddings): a Qwen3-MoE whose every MLP routes each
token to 8 of 64 experts of 128 (a scaled-down Qwen3-30B-A3B: 8 x 128 = 1024 active MLP
rows), and a dense Qwen3 whose MLP is those 1024 rows: the same work per token, so the
gap between them is what routing, gathering and running experts apart costs. Then, in one
process, interleaved per round (``tools/bench/engine.py``'s runs): a single stream's decode and
``--concurrency`` concurrent requests through the engine for each model, and transformers'
``generate()`` on the MoE model, one request after another. Each side's median round. fp32 CPU;
``--quantization`` puts both engines' linears (experts included, routers not) in that format
(transformers stays fp32).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from common.tokenizer import Tokenizer
from gpu.engine import Engine, EngineConfig
from gpu.gguf import resolve_model_path
from gpu.loader import load_model
from gpu.runner import ModelRunner
from tools.bench.engine import (
    Result,
    chat_prompts,
    load_hf,
    median_round,
    run_decode_only,
    run_engine,
    run_hf_sequential,
)

SHAPE: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, num_hidden_layers=12, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
MOE: dict[str, Any] = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], intermediate_size=1024,
    num_experts=64, num_experts_per_tok=8, moe_intermediate_size=128, norm_topk_prob=True,
)  # fmt: skip
DENSE: dict[str, Any] = dict(
    model_type="qwen3", architectures=["Qwen3ForCausalLM"], intermediate_size=1024
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_models(root: Path) -> dict[str, Path]:
    """The two random models, each with the default model's tokenizer."""
    from tools.gpu_check.check_model import write_synthetic_model

    default = resolve_model_path(None)
    folders = {}
    for name, family in (("moe", MOE), ("dense", DENSE)):
        folder = write_synthetic_model(root / name, {**SHAPE, **family})
        for file in TOKENIZER_FILES:
            if (default / file).is_file():
                shutil.copy(default / file, folder / file)
        folders[name] = folder
    return folders


def engine_for(folder: Path, concurrency: int, quantization: str = "none") -> Engine:
    model = load_model(folder, progress=False, quantization=quantization)
    runner = ModelRunner(model, num_pages=2048, page_size=16)
    config = EngineConfig(max_num_batched_tokens=1024, max_num_seqs=max(64, concurrency))
    return Engine(runner, config, [])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.moe", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hf-requests", type=int, default=4)
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        folders = write_models(Path(tmp))
        tokenizer = Tokenizer.from_folder(folders["moe"])
        prompts = chat_prompts(tokenizer, args.concurrency)
        engines = {
            name: engine_for(folder, args.concurrency, args.quantization)
            for name, folder in folders.items()
        }
        hf = load_hf(str(folders["moe"]))
        hf_prompts = prompts[: args.hf_requests]
        for engine in engines.values():  # the same untimed warm-up for every side
            run_engine(engine, prompts[:2], 4, "warm-up")
        run_hf_sequential(hf, prompts[:2], 4)
        rounds: list[list[Result]] = []
        for _ in range(args.rounds):
            row: list[Result] = []
            for engine in engines.values():
                single = run_decode_only(engine, prompts[0], args.output_tokens)
                batched = run_engine(
                    engine, prompts, args.output_tokens, f"{args.concurrency} concurrent"
                )
                row += [single, batched]
            row.append(run_hf_sequential(hf, hf_prompts, args.output_tokens))
            rounds.append(row)
    medians = [median_round([r[i] for r in rounds]) for i in range(len(rounds[0]))]
    names = [f"{model}, {side}" for model in engines for side in ("1 stream", "concurrent")]
    names.append("transformers generate() on moe, sequential")
    print(
        f"\nlinears in {args.quantization} on the CPU, "
        f"{torch.get_num_threads()} threads, {args.output_tokens} output tokens per "
        f"request, {args.concurrency} concurrent, median of {args.rounds} interleaved rounds\n"
    )
    print(f"| {'run':<44} | requests | tokens/s |")
    print(f"|{'-' * 46}|----------|----------|")
    for name, result in zip(names, medians, strict=True):
        print(f"| {name:<44} | {result.requests:>8} | {result.tokens_per_s:>8.1f} |")
    moe_single, moe_batched, dense_single, dense_batched, hf_result = medians
    print(
        f"\nmoe / dense: {moe_single.tokens_per_s / dense_single.tokens_per_s:.2f}x one stream, "
        f"{moe_batched.tokens_per_s / dense_batched.tokens_per_s:.2f}x concurrent; "
        f"moe concurrent / transformers sequential: "
        f"{moe_batched.tokens_per_s / hf_result.tokens_per_s:.1f}x"
    )


if __name__ == "__main__":
    main()
