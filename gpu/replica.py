"""One model replica ready to run steps: on one device, or split over ranks (``gpu.parallel``).

The executor and ``meshserve generate`` build their runner here, so a replica of N ranks is
started the same way everywhere: the other ranks are spawned first and load their shards
while this process (rank 0) loads its own.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpu.config import ModelConfig
from gpu.loader import load_model
from gpu.parallel.launch import RankGroup, RankSpec
from gpu.parallel.shard import check_tensor_parallel
from gpu.quant import kv_cache_dtype
from gpu.runner import ModelRunner


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
) -> ModelRunner:
    """The runner for ``folder``; ``tensor_parallel_size`` > 1 starts that many ranks (one
    device each: ``cuda:0..N-1`` from ``device``'s index, or the CPU's cores shared: each
    rank, this one included, gets ``torch.get_num_threads() // N`` threads; their
    all-reduces go through shared memory unless ``shared_memory`` is False: Gloo). Raises
    ``ModelError`` for a model whose heads cannot be split so, before any rank starts.
    ``cuda_graphs``: decode steps from CUDA graphs once captured (one CUDA device only: a
    split replica decodes eagerly). ``fused_rope_append``: ``ModelRunner``'s option."""
    if tensor_parallel_size == 1:
        model = load_model(folder, device=device, quantization=quantization, progress=progress)
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
