"""The paged KV pool: one tensor per layer, FlashInfer's NHD layout.

``layers[i]`` has shape ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (index 0 of the
second axis holds keys, 1 values), which is what ``append_paged_kv_cache`` and the FlashInfer
wrappers take as ``paged_kv_cache``. The pool only holds memory; which sequence owns which
page is the page manager's business (see ``gpu/page_manager.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.kv_layout import KVLayout
from gpu.config import ModelConfig
from gpu.host_memory import huge_page_zeros


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
    def __init__(
        self, spec: KVCacheSpec, device: torch.device | str = "cpu", pad_pages: int = 0
    ) -> None:
        """``pad_pages`` extra pages after the ``spec.num_pages`` the page manager hands out:
        where the padding rows of a CUDA-graph decode step write (``gpu/graph_batches.py``);
        no sequence ever owns them (page ids ``spec.num_pages`` and up)."""
        self.spec = spec
        self.pad_pages = pad_pages
        rows = spec.num_pages + pad_pages
        shape = (rows, 2, spec.page_size, spec.num_kv_heads, spec.head_dim)
        on_host = torch.device(device).type == "cpu"
        self.layers = [
            huge_page_zeros(shape, spec.dtype)
            if on_host
            else torch.zeros(shape, dtype=spec.dtype, device=device)
            for _ in range(spec.num_layers)
        ]

    def layout(self) -> KVLayout:
        """The pool's addresses for a transport (each layer is one contiguous buffer)."""
        first = self.layers[0]
        page_bytes = first[0].numel() * first.element_size()
        return KVLayout(tuple(t.data_ptr() for t in self.layers), page_bytes, self.spec.num_pages)

    def export_pages(self, pages: list[int]) -> torch.Tensor:
        """A copy of these pages of every layer: ``[num_layers, len(pages), 2, page_size, ...]``."""
        index = torch.tensor(pages, dtype=torch.long, device=self.layers[0].device)
        return torch.stack([t.index_select(0, index) for t in self.layers])

    def import_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Write ``export_pages``' output into these pages (another pool's, same layout)."""
        index = torch.tensor(pages, dtype=torch.long, device=self.layers[0].device)
        for layer, values in zip(self.layers, data, strict=True):
            layer.index_copy_(0, index, values.to(layer.device, layer.dtype))
