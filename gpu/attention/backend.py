"""The attention backend contract shared by the torch (CPU, reference) and FlashInfer backends."""

from __future__ import annotations

from typing import Protocol

import torch

from gpu.attention.metadata import BatchMetadata


class AttentionBackend(Protocol):
    """Per step: ``plan`` once with the batch metadata, then ``attend`` once per layer.

    ``attend`` first appends the new tokens' keys and values to ``kv_cache`` (one layer's
    ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` tensor), then returns causal attention
    of ``q`` over each sequence's whole paged KV. Shapes: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``,
    result ``[T, Hq, D]``.

    ``rotates_qk``: the backend applies the rotary embedding to q and k itself, fused with the
    append (``gpu/attention/rope_append.py``), so the layer passes them unrotated.
    """

    rotates_qk: bool

    def plan(self, meta: BatchMetadata) -> None: ...

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor: ...
