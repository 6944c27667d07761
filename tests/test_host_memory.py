"""The CPU KV pool on transparent huge pages (gpu/host_memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu.host_memory import HUGE_PAGE, huge_page_zeros, huge_pages_backing
from gpu.kv_cache import KVCache, KVCacheSpec

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_available() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def test_a_huge_page_tensor_is_zeroed_aligned_and_outlives_its_maker() -> None:
    t = huge_page_zeros((3, 5, 7), torch.float32)
    assert t.shape == (3, 5, 7) and t.dtype == torch.float32
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    view = t[1]
    del t  # the view keeps the mapping alive
    view.fill_(2.0)
    assert float(view.sum()) == 2.0 * 35


@pytest.mark.skipif(not thp_available(), reason="this kernel gives no transparent huge pages")
def test_the_cpu_kv_pool_is_backed_by_huge_pages() -> None:
    spec = KVCacheSpec(num_layers=2, num_pages=256, page_size=16, num_kv_heads=2,
                       head_dim=64, dtype=torch.float32)  # fmt: skip
    kv = KVCache(spec)  # 4 MiB per layer
    assert all(layer.data_ptr() % HUGE_PAGE == 0 for layer in kv.layers)
    pool_bytes = sum(layer.numel() * layer.element_size() for layer in kv.layers)
    assert huge_pages_backing(kv.layers) >= pool_bytes
