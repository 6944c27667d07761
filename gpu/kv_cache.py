"""The paged KV pool: one tensor per layer, FlashInfer's NHD layout.

``layers[i]`` has shape ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (index 0 of the
second axis holds keys, 1 values), which is what ``append_paged_kv_cache`` and the FlashInfer
wrappers take as ``paged_kv_cache``. The pool only holds memory; which sequence owns which
page is the page manager's business (see ``gpu/page_manager.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.num_pages < 1 or self.page_size < 1:
            raise ValueError("num_pages and page_size must be >= 1")

    @classmethod
    def for_model(
        cls, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype
    ) -> KVCacheSpec:
        return cls(
            num_layers=config.num_hidden_layers,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=dtype,
        )

    @property
    def bytes_per_page(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * elem

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size


class KVCache:
    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        shape = (spec.num_pages, 2, spec.page_size, spec.num_kv_heads, spec.head_dim)
        self.layers = [
            torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]
