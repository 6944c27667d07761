"""Per-step batch metadata in FlashInfer's paged layout, shared by every attention backend.

A step runs one forward pass over a flat list of new tokens from several sequences. Each
sequence contributes ``num_new`` query tokens on top of ``num_computed`` tokens already in
the cache (a prompt chunk, a single decode token, or k+1 speculative positions: one rule).
The KV of the new tokens is appended to the sequence's pages, then every query attends to
all keys at or before its own position.

Layout (as FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper.plan`` expects, int32):
- ``qo_indptr[b]:qo_indptr[b+1]`` are sequence b's query rows in the flat token batch;
- ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` are its pages, in order;
- ``kv_last_page_len[b]`` is how many slots of its last page hold keys (1..page_size).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from gpu.config import ModelError


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step. ``page_table`` must cover computed + new tokens."""

    page_table: tuple[int, ...]
    num_computed: int
    num_new: int
    adapter: int = 0  # the sequence's LoRA adapter slot (``gpu.lora.LoraSet``; 0: none)

    @property
    def kv_len(self) -> int:
        return self.num_computed + self.num_new


@dataclass(frozen=True)
class BatchMetadata:
    page_size: int
    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int32 [num pages used]
    kv_last_page_len: torch.Tensor  # int32 [B]
    positions: torch.Tensor  # int64 [T]: each new token's position in its sequence
    batch_indices: torch.Tensor  # int32 [T]: which sequence each new token belongs to
    append_pages: torch.Tensor  # int64 [T]: page that receives each new token's KV
    append_offsets: torch.Tensor  # int64 [T]: slot within that page
    logits_indices: torch.Tensor  # int64 [B]: the last new token of each sequence
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    def to(self, device: torch.device | str) -> BatchMetadata:
        """On ``device``; to CUDA through pinned memory, so no copy waits for the stream (a
        copy from pageable memory may: the overlapped step loop queues a step behind another)."""
        from gpu.transfers import move

        device = torch.device(device)
        moved: dict[str, Any] = {
            f.name: move(getattr(self, f.name), device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


def build_batch_metadata(chunks: list[SeqChunk], page_size: int) -> BatchMetadata:
    """Describe one step's batch. Built on the CPU once per step and shared by every layer."""
    if not chunks:
        raise ValueError("a step needs at least one sequence")
    qo_indptr = [0]
    kv_indptr = [0]
    kv_indices: list[int] = []
    last_page_len: list[int] = []
    positions: list[int] = []
    batch_indices: list[int] = []
    append_pages: list[int] = []
    append_offsets: list[int] = []
    for b, chunk in enumerate(chunks):
        if chunk.num_new < 1 or chunk.num_computed < 0:
            raise ValueError(f"sequence {b}: num_new must be >= 1 and num_computed >= 0")
        pages_needed = -(-chunk.kv_len // page_size)
        if len(chunk.page_table) < pages_needed:
            raise ModelError(
                f"sequence {b}: {chunk.kv_len} tokens need {pages_needed} pages, "
                f"page table has {len(chunk.page_table)}"
            )
        pages = chunk.page_table[:pages_needed]
        kv_indices.extend(pages)
        kv_indptr.append(len(kv_indices))
        last_page_len.append(chunk.kv_len - (pages_needed - 1) * page_size)
        qo_indptr.append(qo_indptr[-1] + chunk.num_new)
        for pos in range(chunk.num_computed, chunk.kv_len):
            positions.append(pos)
            batch_indices.append(b)
            append_pages.append(pages[pos // page_size])
            append_offsets.append(pos % page_size)
    i32, i64 = torch.int32, torch.int64
    return BatchMetadata(
        page_size=page_size,
        qo_indptr=torch.tensor(qo_indptr, dtype=i32),
        kv_indptr=torch.tensor(kv_indptr, dtype=i32),
        kv_indices=torch.tensor(kv_indices, dtype=i32),
        kv_last_page_len=torch.tensor(last_page_len, dtype=i32),
        positions=torch.tensor(positions, dtype=i64),
        batch_indices=torch.tensor(batch_indices, dtype=i32),
        append_pages=torch.tensor(append_pages, dtype=i64),
        append_offsets=torch.tensor(append_offsets, dtype=i64),
        logits_indices=torch.tensor(qo_indptr[1:], dtype=i64) - 1,
        q_lens=tuple(c.num_new for c in chunks),
        kv_lens=tuple(c.kv_len for c in chunks),
    )
