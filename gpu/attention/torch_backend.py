"""Paged attention in plain torch: the CPU backend and the reference FlashInfer is checked against.

``plan`` turns the metadata into gather indices and masks once per step; ``attend`` (per layer)
then does one scatter into the cache, one gather of pages and one SDPA call per group. Decodes
(one query each) form one padded group; each multi-token sequence (a prompt chunk or speculative
verification) is its own group, so a long prompt never pads the decodes beside it.

Grouped-query attention is done without repeating K/V: queries are folded to
``[Hkv, G * T, D]`` so each KV head serves its G query heads in one matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu.attention.metadata import BatchMetadata


@dataclass(frozen=True)
class _Group:
    token_rows: torch.Tensor  # int64 [B * Q]: flat token index of each (seq, query) slot
    pages: torch.Tensor  # int64 [B, P]: page ids, padded with page 0
    mask: torch.Tensor  # bool [B, 1, Q, P * page_size]: True where attention is allowed
    batch: int
    q_len: int
    kv_len: int  # padded key length P * page_size


class TorchPagedAttention:
    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_q_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self._groups: list[_Group] = []
        self._single = False
        self._append_pages = torch.empty(0, dtype=torch.int64)
        self._append_offsets = torch.empty(0, dtype=torch.int64)

    def plan(self, meta: BatchMetadata) -> None:
        device = meta.positions.device
        ps = meta.page_size
        qo = meta.qo_indptr.tolist()
        kvp = meta.kv_indptr.tolist()
        pages_all = meta.kv_indices.tolist()
        decodes = [b for b, q in enumerate(meta.q_lens) if q == 1]
        others = [b for b, q in enumerate(meta.q_lens) if q > 1]
        groups = []
        for members in ([decodes] if decodes else []) + [[b] for b in others]:
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
            key_pos = torch.arange(kv_len).view(1, 1, kv_len)
            lens = torch.tensor(kv_lens).view(-1, 1, 1)
            # query i of a sequence with L keys sits at position L - q_len + i.
            query_pos = lens - q_len + torch.arange(q_len).view(1, q_len, 1)
            mask = (key_pos <= query_pos) & (key_pos < lens)
            groups.append(
                _Group(
                    token_rows=torch.tensor(rows, dtype=torch.int64, device=device),
                    pages=pages.to(device),
                    mask=mask.unsqueeze(1).to(device),
                    batch=len(members),
                    q_len=q_len,
                    kv_len=kv_len,
                )
            )
        self._groups = groups
        # One group covering the batch in order (pure decode, or a single prompt chunk) needs
        # no scatter of its output back into the flat token order.
        self._single = len(groups) == 1 and groups[0].token_rows.tolist() == list(
            range(meta.num_tokens)
        )
        self._append_pages = meta.append_pages
        self._append_offsets = meta.append_offsets

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        kv_cache[self._append_pages, :, self._append_offsets] = torch.stack((k, v), dim=1)
        if self._single:
            return self._attend_group(q, self._groups[0], kv_cache)
        out = torch.empty_like(q)
        for group in self._groups:
            out[group.token_rows] = self._attend_group(q[group.token_rows], group, kv_cache)
        return out

    def _attend_group(self, q: torch.Tensor, group: _Group, kv_cache: torch.Tensor) -> torch.Tensor:
        b, t, hkv, g, d = group.batch, group.q_len, self.num_kv_heads, self.group, self.head_dim
        # Indexing the strided K (or V) view by page gives a contiguous [B, P, ps, Hkv, D] copy.
        keys = kv_cache[:, 0][group.pages].view(b, group.kv_len, hkv, d).transpose(1, 2)
        values = kv_cache[:, 1][group.pages].view(b, group.kv_len, hkv, d).transpose(1, 2)
        # [B*T, Hq, D] -> [B, Hkv, G*T, D]: each KV head's query heads become extra rows.
        qg = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
        mask = group.mask.expand(b, 1, t, group.kv_len)
        if g > 1:
            mask = mask.unsqueeze(2).expand(b, 1, g, t, group.kv_len).reshape(b, 1, g * t, -1)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scale)
        return out.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b * t, hkv * g, d)
