"""One model replica ready to run steps: on one device, or split over ranks (``gpu.parallel``).

The executor and ``meshserve generate`` build their runner here, so a replica of N ranks is
started the same way everywhere: the other ranks are spawned first and load their shards
while this process (rank 0) loads its own.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from gpu.config import ModelConfig
from gpu.engine import EngineConfig
from gpu.formats import TRITON_GEMV_MODES
from gpu.loader import load_model
from gpu.model import CausalLM
from gpu.parallel.launch import RankGroup, RankSpec
from gpu.parallel.shard import check_tensor_parallel
from gpu.quant import kv_cache_dtype
from gpu.runner import ModelRunner

log = logging.getLogger(__name__)


def _use_triton_gemv(model: CausalLM, mode: str, quantization: str) -> None:
    """``--triton-gemv matmuls|layers`` on a CUDA model; ``layers`` where some linear cannot
    take it (a quantized one) falls back to ``matmuls`` with a warning, not a failed start."""
    from gpu.triton_gemv import MAX_ROWS

    try:
        switched = model.use_triton_gemv(MAX_ROWS, fuse_layers=mode == "layers")
    except ValueError as exc:
        log.warning("--triton-gemv layers: %s; running matmuls instead", exc)
        switched = model.use_triton_gemv(MAX_ROWS)
    if not switched:
        log.warning("--triton-gemv %s: no fp16/bf16 dense linear (quantization %s)",
                    mode, quantization)  # fmt: skip


def build_runner(
    folder: Path,
    device: torch.device | str = "cpu",
    quantization: str = "none",
    num_pages: int = 1024,
    page_size: int = 16,
    kv_cache: str = "auto",
    tensor_parallel_size: int = 1,
    timeout_s: float = 30.0,
    progress: bool = True,
    shared_memory: bool = True,
    cuda_graphs: bool = False,
    fused_rope_append: bool = False,
    triton_gemv: str = "off",
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
) -> ModelRunner:
    """The runner for ``folder``; ``tensor_parallel_size`` > 1 starts that many ranks (one
    device each: ``cuda:0..N-1`` from ``device``'s index, or the CPU's cores shared: each
    rank, this one included, gets ``torch.get_num_threads() // N`` threads; their
    all-reduces go through shared memory unless ``shared_memory`` is False: Gloo). Raises
    ``ModelError`` for a model whose heads cannot be split so, before any rank starts.
    ``cuda_graphs``: decode steps from CUDA graphs once captured (one CUDA device only: a
    split replica decodes eagerly). ``fused_rope_append``: ``ModelRunner``'s option.
    ``triton_gemv`` (``TRITON_GEMV_MODES``): steps of a few tokens through
    ``gpu.triton_gemv`` (``CausalLM.use_triton_gemv``; CUDA on one device only).
    ``max_num_batched_tokens``: the engine's longest step, for which the other ranks of a
    split replica build their Triton matmuls before they say they are ready (rank 0's
    ``Engine.warm_up`` builds its own)."""
    if triton_gemv not in TRITON_GEMV_MODES:
        raise ValueError(f"triton_gemv is one of {', '.join(TRITON_GEMV_MODES)}, not {triton_gemv}")
    if triton_gemv != "off" and (torch.device(device).type != "cuda" or tensor_parallel_size > 1):
        log.warning("--triton-gemv %s runs on one CUDA device only: ignored", triton_gemv)
        triton_gemv = "off"
    if tensor_parallel_size == 1:
        model = load_model(folder, device=device, quantization=quantization, progress=progress)
        if triton_gemv != "off":
            _use_triton_gemv(model, triton_gemv, quantization)
        kv_dtype = kv_cache_dtype(kv_cache, model.dtype)
        return ModelRunner(
            model, num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype,
            cuda_graphs=cuda_graphs, fused_rope_append=fused_rope_append,
        )  # fmt: skip
    check_tensor_parallel(ModelConfig.from_folder(Path(folder)), tensor_parallel_size)
    # The ranks share this process's threads: N processes of all of them would oversubscribe
    # the cores, and a collective waits for the rank that lost its core.
    threads = max(1, torch.get_num_threads() // tensor_parallel_size)
    torch.set_num_threads(threads)
    spec = RankSpec(
        model=str(folder), world=tensor_parallel_size, device=str(device),
        quantization=quantization, kv_cache_dtype=kv_cache, num_pages=num_pages,
        page_size=page_size, threads=threads, timeout_s=timeout_s, shared_memory=shared_memory,
        warm_rows=max_num_batched_tokens,
    )  # fmt: skip
    group = RankGroup(spec)
    try:
        model = load_model(
            folder, device=spec.device_of(0), quantization=quantization, progress=progress,
            tp=group.comm,
        )  # fmt: skip
        group.wait_ready()
        kv_dtype = kv_cache_dtype(kv_cache, model.dtype)
        return ModelRunner(model, num_pages, page_size, kv_dtype=kv_dtype, peers=group)
    except BaseException:
        group.close()
        raise
