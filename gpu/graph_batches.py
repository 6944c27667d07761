"""The host side of decode steps replayed from CUDA graphs: buckets, padding, staging.

A CUDA graph replays fixed kernels on fixed addresses, so a decode step runs from the graph
captured for the smallest batch-size *bucket* that holds it (``graph_buckets``: 1, 2, 4, 8,
then every 8, as vLLM captures), its batch padded to the bucket with *padding rows*. A padding
row is a one-token sequence on the pool's pad page (an extra page no sequence owns,
``gpu/kv_cache.py``): its key and value land there, its query attends to that one slot, and
its logits row is dropped. Real rows come first, so the graph's output rows ``[:batch]`` are
the step's logits in batch order.

Everything a decode step varies lives in one int32 *staging* buffer laid out per bucket
(``StagingLayout``): token ids, positions, ``kv_indptr``, ``kv_last_page_len`` and the page
indices, the last sized for the bucket's most pages (every row at the longest sequence the pool
can hold). The engine writes it into pinned host memory (``fill_staging``) and one
host-to-device copy moves the whole step; the graph reads fixed views of the device copy. The
row of each token (``batch_indices``) is ``arange(bucket)`` for a decode and never changes.

This module is plain torch on the CPU (tested there); ``gpu/graph_runner.py`` captures and
replays the graphs on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.attention.metadata import BatchMetadata

SMALL_BUCKETS = (1, 2, 4)
BUCKET_STEP = 8


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes that get a graph: 1, 2, 4, then every multiple of 8, up to the first
    one that holds ``max_num_seqs`` (so the largest batch has a bucket)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = max(max_num_seqs, BUCKET_STEP)
    candidates = [*SMALL_BUCKETS, *range(BUCKET_STEP, top + BUCKET_STEP, BUCKET_STEP)]
    kept = [b for b in candidates if b < max_num_seqs]
    return (*kept, next(b for b in candidates if b >= max_num_seqs))


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``batch`` rows; None above the largest (run eagerly)."""
    if batch < 1:
        raise ValueError(f"a batch has at least one row, got {batch}")
    return next((b for b in buckets if b >= batch), None)


@dataclass(frozen=True)
class StagingLayout:
    """Where each of a decode step's inputs sits in the int32 staging buffer of one bucket
    (element offsets; the buffer holds ``size`` elements)."""

    bucket: int
    max_pages: int  # page indices the bucket's rows may hold together

    @property
    def input_ids(self) -> slice:
        return slice(0, self.bucket)

    @property
    def positions(self) -> slice:
        return slice(self.bucket, 2 * self.bucket)

    @property
    def kv_indptr(self) -> slice:
        return slice(2 * self.bucket, 3 * self.bucket + 1)

    @property
    def kv_last_page_len(self) -> slice:
        return slice(3 * self.bucket + 1, 4 * self.bucket + 1)

    @property
    def kv_indices(self) -> slice:
        return slice(4 * self.bucket + 1, 4 * self.bucket + 1 + self.max_pages)

    @property
    def size(self) -> int:
        return 4 * self.bucket + 1 + self.max_pages

    @property
    def meta_end(self) -> int:
        """Elements before the page indices: a step copies these plus its pages' only."""
        return 4 * self.bucket + 1

    @classmethod
    def for_bucket(cls, bucket: int, max_seq_len: int, page_size: int) -> StagingLayout:
        """Room for every row at ``max_seq_len`` tokens (padding rows hold one page each)."""
        return cls(bucket, bucket * -(-max_seq_len // page_size))


def fill_staging(
    host: torch.Tensor,
    layout: StagingLayout,
    input_ids: torch.Tensor,
    meta: BatchMetadata,
    pad_page: int,
) -> int:
    """Write a decode step (host tensors) into ``host`` (int32, at least ``layout.size``) as
    ``layout`` places it, padded to the bucket; returns how many leading elements the step
    uses (what the host-to-device copy must move). Raises ``ValueError`` for a step the
    bucket's graph cannot run: not all decodes, more rows than the bucket, too many pages."""
    b, n = layout.bucket, meta.num_seqs
    if not meta.is_decode_only:
        raise ValueError("only a step of decodes (one new token per sequence) replays a graph")
    if n > b:
        raise ValueError(f"{n} sequences do not fit the bucket of {b}")
    pages = int(meta.kv_indices.numel())
    if pages + (b - n) > layout.max_pages:
        raise ValueError(f"{pages} pages do not fit the bucket's {layout.max_pages}")
    if host.dtype != torch.int32 or host.numel() < layout.size:
        raise ValueError(f"the staging buffer must be int32 of >= {layout.size} elements")
    pad = b - n
    host[layout.input_ids][:n] = input_ids
    host[layout.input_ids][n:] = 0
    host[layout.positions][:n] = meta.positions
    host[layout.positions][n:] = 0
    indptr = host[layout.kv_indptr]
    indptr[: n + 1] = meta.kv_indptr
    # Each padding row: one more page (the pad page), one key in it.
    indptr[n + 1 :] = torch.arange(pages + 1, pages + pad + 1, dtype=torch.int32)
    host[layout.kv_last_page_len][:n] = meta.kv_last_page_len
    host[layout.kv_last_page_len][n:] = 1
    start: int = layout.kv_indices.start
    host[start : start + pages] = meta.kv_indices
    host[start + pages : start + pages + pad] = pad_page
    return start + pages + pad


def padded_batch_indices(bucket: int) -> torch.Tensor:
    """Which row each token of a decode step belongs to: its own (int32 ``[bucket]``)."""
    return torch.arange(bucket, dtype=torch.int32)
