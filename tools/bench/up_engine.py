"""The engine each executor of ``meshserve up`` builds with its defaults (the model's weight
format, KV pages, step budget), in this process: what the in-process benchmarks run."""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

from common.tokenizer import Tokenizer
from gpu.engine import Engine, EngineConfig
from gpu.gguf import resolve_model_path
from gpu.replica import build_runner
from services.launcher.up import parse_up_args


@dataclass(frozen=True)
class UpEngine:
    folder: Path
    tokenizer: Tokenizer
    engine: Engine
    up: Namespace  # meshserve up's flags, at their defaults


def up_engine(model: str | None) -> UpEngine:
    """``model``: a folder, a .gguf file, or None (the default model)."""
    up = parse_up_args([])
    folder = resolve_model_path(model)
    tokenizer = Tokenizer.from_folder(folder)
    runner = build_runner(
        folder, quantization=up.quantization, num_pages=up.kv_cache_tokens // up.page_size,
        page_size=up.page_size, kv_cache=up.kv_cache_dtype, progress=False,
    )  # fmt: skip
    config = EngineConfig(up.max_num_batched_tokens, up.max_num_seqs)
    return UpEngine(folder, tokenizer, Engine(runner, config, tokenizer.eos_token_ids), up)
