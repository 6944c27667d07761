"""Flags that more than one ``meshserve`` subcommand takes."""

from __future__ import annotations

import argparse

from gpu.formats import KV_CACHE_DTYPES, QUANTIZATIONS


def add_model_format_args(p: argparse.ArgumentParser) -> None:
    """``--quantization`` and ``--kv-cache-dtype`` (shared by ``generate`` and ``up``)."""
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="auto",
        help="weight format (auto: a GGUF model in its own blocks on CPU, else none; gguf: the "
        "file's Q4_0/Q4_1/Q8_0 blocks; int8: per channel, W8A8 on CPU; int4: 4-bit groups of "
        "32; fp8: e4m3, Hopper/Ada or CPU emulation)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache storage (auto: the model's dtype)",
    )


def add_tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size`` (``generate`` and ``up``: each executor's replica)."""
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split each model replica across N ranks, one device each (heads, MLP and "
        "vocabulary; gloo on CPU, NCCL on CUDA); the head counts must divide",
    )
