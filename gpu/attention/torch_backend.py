"""Paged attention in plain torch: the CPU backend and the reference FlashInfer is checked against.

``plan`` turns the metadata into gather indices and masks once per step; ``attend`` (per layer)
then does one scatter into the cache, one gather of pages and one SDPA call per group. Decodes
(one query each) form one padded group; each multi-token sequence (a prompt chunk or speculative
verification) is its own group, so a long prompt never pads the decodes beside it.

Grouped-query attention is done without repeating K/V: queries are folded to
``[Hkv, G * T, D]`` so each KV head serves its G query heads in one matmul.

With ``kernels`` (fp32 on CPU) the decodes skip all of that: one call of
``CpuKernels.paged_decode_attention`` per layer appends their K/V and attends straight from the
pages (no gather copy, no mask); prompt chunks still take the SDPA path.

The cache may be stored in another dtype than the queries (an fp8 KV cache): keys and values are
converted on append and on gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu.attention.metadata import BatchMetadata
from gpu.cpu_kernels import CpuKernels, DecodeAttention


@dataclass(frozen=True)
class _Group:
    token_rows: torch.Tensor  # int64 [B * Q]: flat token index of each (seq, query) slot
    kv_rows: torch.Tensor  # int64 [2 * B * L]: rows of the cache viewed [pages * 2 * ps, Hkv, D]
    mask: torch.Tensor  # bool [B, 1, G * Q, L]: True where attention is allowed
    batch: int
    q_len: int
    kv_len: int  # padded key length L = P * page_size


class TorchPagedAttention:
    rotates_qk = False  # the layer rotates q and k (gpu.ops)

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kernels: CpuKernels | None = None,
    ) -> None:
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_q_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # The decode kernel needs fp32 q and cache and head_dim % 8 == 0; the runner only passes
        # kernels when that holds.
        self.kernels = kernels if head_dim % 8 == 0 else None
        self._groups: list[_Group] = []
        self._single = False
        self._decodes: DecodeAttention | None = None
        self._other_rows: torch.Tensor | None = None
        self._append_pages = torch.empty(0, dtype=torch.int64)
        self._append_offsets = torch.empty(0, dtype=torch.int64)

    def plan(self, meta: BatchMetadata) -> None:
        device = meta.positions.device
        qo = meta.qo_indptr.tolist()
        kvp = meta.kv_indptr.tolist()
        pages_all = meta.kv_indices.tolist()
        decodes = [b for b, q in enumerate(meta.q_lens) if q == 1]
        others = [b for b, q in enumerate(meta.q_lens) if q > 1]
        self._decodes = None
        if self.kernels is not None and decodes and device.type == "cpu":
            self._decodes = _decode_attention(
                self.kernels, meta, decodes, qo, kvp, pages_all, self.scale
            )
            groups = [self._group(meta, [b], qo, kvp, pages_all) for b in others]
        else:
            members = ([decodes] if decodes else []) + [[b] for b in others]
            groups = [self._group(meta, m, qo, kvp, pages_all) for m in members]
        self._groups = groups
        # One group covering the batch in order (pure decode, or a single prompt chunk) needs
        # no scatter of its output back into the flat token order.
        self._single = (
            self._decodes is None
            and len(groups) == 1
            and groups[0].token_rows.tolist() == list(range(meta.num_tokens))
        )
        if self._decodes is None:
            self._append_pages = meta.append_pages
            self._append_offsets = meta.append_offsets
        else:  # the kernel appends the decodes' K/V itself; torch appends the rest
            rows = torch.cat([g.token_rows for g in groups]) if groups else None
            self._append_pages = meta.append_pages if rows is None else meta.append_pages[rows]
            self._append_offsets = (
                meta.append_offsets if rows is None else meta.append_offsets[rows]
            )
            self._other_rows = rows

    def decode_only(self) -> DecodeAttention | None:
        """This step's decode kernel when every token is a decode (token b of sequence b)."""
        return self._decodes if self._decodes is not None and not self._groups else None

    def _group(
        self,
        meta: BatchMetadata,
        members: list[int],
        qo: list[int],
        kvp: list[int],
        pages_all: list[int],
    ) -> _Group:
        ps, g = meta.page_size, self.group
        q_len = meta.q_lens[members[0]]
        max_pages = max(kvp[b + 1] - kvp[b] for b in members)
        pages = torch.zeros((len(members), max_pages), dtype=torch.int64)
        rows: list[int] = []
        kv_lens = []
        for i, b in enumerate(members):
            seq_pages = pages_all[kvp[b] : kvp[b + 1]]
            pages[i, : len(seq_pages)] = torch.tensor(seq_pages, dtype=torch.int64)
            rows.extend(range(qo[b], qo[b + 1]))
            kv_lens.append(meta.kv_lens[b])
        kv_len = max_pages * ps
        # Cache row of (page, k|v, slot) in the [pages * 2 * ps, Hkv, D] view; keys then values.
        slot = torch.arange(ps).view(1, 1, ps)
        key_rows = (pages.unsqueeze(-1) * 2 * ps + slot).view(-1)
        kv_rows = torch.cat((key_rows, key_rows + ps))
        key_pos = torch.arange(kv_len).view(1, 1, kv_len)
        lens = torch.tensor(kv_lens).view(-1, 1, 1)
        # query i of a sequence with L keys sits at position L - q_len + i.
        query_pos = lens - q_len + torch.arange(q_len).view(1, q_len, 1)
        mask = (key_pos <= query_pos) & (key_pos < lens)  # [B, Q, L]
        b = len(members)
        # Expanded once per step to the folded [G * Q] query rows (each KV head's G heads).
        mask = mask.unsqueeze(1).expand(b, g, q_len, kv_len).reshape(b, 1, g * q_len, kv_len)
        device = meta.positions.device
        return _Group(
            token_rows=torch.tensor(rows, dtype=torch.int64, device=device),
            kv_rows=kv_rows.to(device),
            mask=mask.to(device),
            batch=b,
            q_len=q_len,
            kv_len=kv_len,
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        if self._decodes is not None:
            return self._attend_with_kernel(q, k, v, kv_cache, self._decodes)
        new = torch.stack((k, v), dim=1).to(kv_cache.dtype)
        kv_cache[self._append_pages, :, self._append_offsets] = new
        if self._single:
            return self._attend_group(q, self._groups[0], kv_cache)
        out = torch.empty_like(q)
        for group in self._groups:
            out[group.token_rows] = self._attend_group(q[group.token_rows], group, kv_cache)
        return out

    def _attend_with_kernel(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        decodes: DecodeAttention,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        if self._groups:  # prompt chunks: their K/V first, then SDPA per chunk
            rows = self._other_rows
            assert rows is not None
            new = torch.stack((k[rows], v[rows]), dim=1).to(kv_cache.dtype)
            kv_cache[self._append_pages, :, self._append_offsets] = new
            for group in self._groups:
                out[group.token_rows] = self._attend_group(q[group.token_rows], group, kv_cache)
        decodes(q, k, v, out, kv_cache)
        return out

    def _attend_group(self, q: torch.Tensor, group: _Group, kv_cache: torch.Tensor) -> torch.Tensor:
        b, t, hkv, g, d = group.batch, group.q_len, self.num_kv_heads, self.group, self.head_dim
        # One gather of every key and value page: a contiguous [2, B, L, Hkv, D] copy.
        flat = kv_cache.view(-1, hkv, d)
        kv = flat.index_select(0, group.kv_rows).view(2, b, group.kv_len, hkv, d)
        if kv.dtype != q.dtype:
            kv = kv.to(q.dtype)
        keys, values = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        # [B*T, Hq, D] -> [B, Hkv, G*T, D]: each KV head's query heads become extra rows.
        qg = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
        out = F.scaled_dot_product_attention(
            qg, keys, values, attn_mask=group.mask, scale=self.scale
        )
        return out.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b * t, hkv * g, d)


def _decode_attention(
    kernels: CpuKernels,
    meta: BatchMetadata,
    decodes: list[int],
    qo: list[int],
    kvp: list[int],
    pages_all: list[int],
    scale: float,
) -> DecodeAttention:
    """The step's decode sequences laid out for the kernel (the metadata itself when the whole
    batch decodes)."""
    i32, i64 = torch.int32, torch.int64
    if len(decodes) == meta.num_seqs:
        return kernels.decode_attention(
            torch.arange(meta.num_seqs, dtype=i64), meta.append_pages, meta.append_offsets,
            meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, scale,
        )  # fmt: skip
    rows = torch.tensor([qo[b] for b in decodes], dtype=i64)
    indptr = [0]
    indices: list[int] = []
    for b in decodes:
        indices.extend(pages_all[kvp[b] : kvp[b + 1]])
        indptr.append(len(indices))
    return kernels.decode_attention(
        rows, meta.append_pages[rows], meta.append_offsets[rows],
        torch.tensor(indptr, dtype=i32), torch.tensor(indices, dtype=i32),
        meta.kv_last_page_len[torch.tensor(decodes, dtype=i64)], scale,
    )  # fmt: skip
