"""One step's batch as a single int64 tensor: what rank 0 broadcasts to the other ranks.

Rank 0 builds ``BatchMetadata`` once (``gpu.runner``); the other ranks receive its tensors, the
token ids and which rows want logits, in one broadcast, and run the same forward pass on
their shards. Layout: a header ``[B, T, P, L, all_logits]`` (sequences, tokens, pages used,
logits rows or -1 for the metadata's own), then qo_indptr, kv_indptr (B+1 each), kv_indices
(P), kv_last_page_len (B), positions, batch_indices, append_pages, append_offsets (T each),
logits_indices (B), the token ids (T) and the requested logits rows (L).
"""

from __future__ import annotations

import torch

from gpu.attention.metadata import BatchMetadata

HEADER = 5


def pack_step(
    input_ids: torch.Tensor,
    meta: BatchMetadata,
    all_logits: bool,
    logits_indices: torch.Tensor | None,
) -> torch.Tensor:
    b, t, p = meta.num_seqs, meta.num_tokens, int(meta.kv_indices.numel())
    rows = -1 if logits_indices is None else int(logits_indices.numel())
    parts = [
        torch.tensor([b, t, p, rows, int(all_logits)], dtype=torch.int64),
        meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
        meta.positions, meta.batch_indices, meta.append_pages, meta.append_offsets,
        meta.logits_indices, input_ids,
    ]  # fmt: skip
    if logits_indices is not None:
        parts.append(logits_indices)
    return torch.cat([x.to(torch.int64).reshape(-1) for x in parts])


def unpack_step(
    buf: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, BatchMetadata, bool, torch.Tensor | None]:
    """``(input_ids, meta, all_logits, logits_indices)`` as rank 0 passed them."""
    b, t, p, rows, all_logits = (int(x) for x in buf[:HEADER])
    sizes = [b + 1, b + 1, p, b, t, t, t, t, b, t, max(rows, 0)]
    fields = list(torch.split(buf[HEADER:], sizes))
    qo, kvp, kvi, last, pos, bidx, pages, offsets, logits, ids, wanted = fields
    i32 = torch.int32
    q_lens = tuple((qo[1:] - qo[:-1]).tolist())
    kv_lens = tuple(((kvp[1:] - kvp[:-1] - 1) * page_size + last).tolist())
    meta = BatchMetadata(
        page_size=page_size,
        qo_indptr=qo.to(i32),
        kv_indptr=kvp.to(i32),
        kv_indices=kvi.to(i32),
        kv_last_page_len=last.to(i32),
        positions=pos.clone(),
        batch_indices=bidx.to(i32),
        append_pages=pages.clone(),
        append_offsets=offsets.clone(),
        logits_indices=logits.clone(),
        q_lens=q_lens,
        kv_lens=kv_lens,
    )
    return ids.clone(), meta, bool(all_logits), wanted.clone() if rows >= 0 else None
