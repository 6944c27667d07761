"""Decode steps replayed from CUDA graphs, one per batch-size bucket (CUDA and FlashInfer only).

A decode step of an 8B model launches ~20 kernels per layer from Python; at batch 1 on a
Hopper GPU the launches, not the weights' read, set the step time. Captured once per bucket
(``gpu/graph_batches.py``), a step is one host-to-device copy of its metadata, FlashInfer's
host-side plan and one graph launch.

Per bucket: a ``BatchDecodeWithPagedKVCacheWrapper`` with ``use_cuda_graph=True`` whose
``paged_kv_indptr_buffer``, ``paged_kv_indices_buffer`` and ``paged_kv_last_page_len_buffer``
are fixed views into the device staging buffer, and a graph of the whole forward pass (embed,
every layer: append_paged_kv_cache + the wrapper's ``run``, final norm, LM head) over fixed
views of the token ids and positions. At replay the step's metadata goes into pinned host
memory, one copy moves it (``fill_staging`` says how much), ``plan`` runs on the host with the
same host views (FlashInfer's plan copies indptr/last_page_len into the buffers again: a few
hundred bytes, and its split-KV schedule needs them on the host anyway), then the graph replays.
All buckets share one staging buffer, one float workspace and one memory pool: graphs never run
at the same time. The pinned buffer is rewritten only once an event recorded behind the
previous step's copies has passed, so no copy still in flight reads it.

Mixed and prefill steps, batches above the largest bucket, speculative verification (several
logits rows per sequence) and tensor-parallel replicas run eagerly. ``flashinfer`` and CUDA are
touched only when ``DecodeGraphs`` is constructed: the module imports anywhere.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gpu.attention import rope_append
from gpu.attention.flashinfer_backend import DEFAULT_WORKSPACE_BYTES, KV_LAYOUT, load_flashinfer
from gpu.attention.metadata import BatchMetadata
from gpu.graph_batches import (
    StagingLayout,
    bucket_for,
    fill_staging,
    graph_buckets,
    padded_batch_indices,
)
from gpu.kv_cache import KVCache
from gpu.model import CausalLM

if TYPE_CHECKING:
    from gpu.runner import TokenFeed

log = logging.getLogger(__name__)
# Eager runs on a side stream before a capture: cuBLAS picks its kernels and allocates its
# workspace, FlashInfer loads its module; none of that may happen inside the capture.
WARMUP_RUNS = 2


class GraphDecodeAttention:
    """The attention backend inside one bucket's graph: the metadata is already in its fixed
    buffers, so ``plan`` does nothing; ``attend`` appends (rotating q and k on the way, with a
    ``rope_cache``: ``FlashInferPagedAttention``'s option) and runs the planned wrapper."""

    def __init__(
        self,
        fi: Any,
        wrapper: Any,
        views: dict[str, torch.Tensor],
        rope_cache: torch.Tensor | None = None,
    ) -> None:
        self._fi = fi
        self.wrapper = wrapper
        self.views = views
        self.rope_cache = rope_cache
        self.rotates_qk = rope_cache is not None

    def plan(self, meta: BatchMetadata) -> None:
        return None

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        views = self.views
        if self.rope_cache is not None:
            rope_append.rope_append_(
                q, k, v, views["positions"], self.rope_cache, kv_cache, views["batch_indices"],
                views["kv_indptr"], views["kv_indices"],
            )  # fmt: skip
        else:
            if k.dtype != kv_cache.dtype:  # an fp8 cache: keys and values stored in e4m3
                k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
            self._fi.append_paged_kv_cache(
                k, v, views["batch_indices"], views["positions"], kv_cache, views["kv_indices"],
                views["kv_indptr"], views["kv_last_page_len"], kv_layout=KV_LAYOUT,
            )  # fmt: skip
        # q stays a view of the qkv rows, as in the eager backend: FlashInfer's decode kernels
        # (both wrappers) read its token and head strides, so a copy would be one more
        # kernel a layer.
        if q.stride(-1) != 1:
            q = q.contiguous()
        out: torch.Tensor = self.wrapper.run(q, kv_cache)
        return out


@dataclass
class _Captured:
    layout: StagingLayout
    graph: Any  # torch.cuda.CUDAGraph
    backend: GraphDecodeAttention
    logits: torch.Tensor  # [bucket, vocab], written by each replay


class DecodeGraphs:
    """Captures and replays decode steps of ``model`` over ``kv`` (its pad page included)."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        pad_page: int,
        max_num_seqs: int,
        max_seq_len: int,
        decode_tensor_cores: bool,
        flashinfer_module: Any | None = None,
        rope_cache: torch.Tensor | None = None,
    ) -> None:
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {model.device}")
        if model.tp is not None:
            raise ValueError("CUDA graphs run on one device: a split replica decodes eagerly")
        self._fi = flashinfer_module or load_flashinfer()
        self.model = model
        self.kv = kv
        self.pad_page = pad_page
        self.page_size = kv.spec.page_size
        self.buckets = graph_buckets(max_num_seqs)
        self.decode_tensor_cores = decode_tensor_cores
        self.rope_cache = rope_cache
        self.layouts = {
            b: StagingLayout.for_bucket(b, max_seq_len, self.page_size) for b in self.buckets
        }
        size = max(layout.size for layout in self.layouts.values())
        device = model.device
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        self.staging = torch.zeros(size, dtype=torch.int32, device=device)
        self.batch_indices = padded_batch_indices(self.buckets[-1]).to(device)
        self.workspace = torch.zeros(DEFAULT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.captured: dict[int, _Captured] = {}
        self.pool: Any = None
        self._staged: Any = None  # torch.cuda.Event after the last step's copies
        self.replays = 0  # steps run from a graph (the GPU check requires some)
        cfg = model.local_config
        self._heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)

    # -- capture ---------------------------------------------------------------------------
    def capture(self) -> float:
        """Capture every bucket, largest first (the smaller ones reuse its memory pool);
        returns the seconds it took."""
        started = time.perf_counter()
        for bucket in reversed(self.buckets):
            self.captured[bucket] = self._capture(bucket)
        torch.cuda.synchronize(self.model.device)
        seconds = time.perf_counter() - started
        log.info("captured %d decode graphs (batch %s) in %.1fs", len(self.buckets),
                 ",".join(map(str, self.buckets)), seconds)  # fmt: skip
        return seconds

    def _views(self, layout: StagingLayout) -> dict[str, torch.Tensor]:
        s = self.staging
        return {
            "input_ids": s[layout.input_ids],
            "positions": s[layout.positions],
            "kv_indptr": s[layout.kv_indptr],
            "kv_last_page_len": s[layout.kv_last_page_len],
            "kv_indices": s[layout.kv_indices],
            "batch_indices": self.batch_indices[: layout.bucket],
        }

    def _capture(self, bucket: int) -> _Captured:
        layout = self.layouts[bucket]
        views = self._views(layout)
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            kv_layout=KV_LAYOUT,
            use_cuda_graph=True,
            use_tensor_cores=self.decode_tensor_cores,
            paged_kv_indptr_buffer=views["kv_indptr"],
            paged_kv_indices_buffer=views["kv_indices"],
            paged_kv_last_page_len_buffer=views["kv_last_page_len"],
            backend="fa2",
        )
        backend = GraphDecodeAttention(self._fi, wrapper, views, self.rope_cache)
        # Captured on a batch of padding rows only: every write lands on the pad page.
        self._stage(layout, self._padding_step(bucket), backend)
        meta = self._fixed_meta(layout, views)
        stream = torch.cuda.Stream(self.model.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self._forward(views, meta, backend)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(views, meta, backend)
        self.pool = graph.pool()
        return _Captured(layout, graph, backend, logits)

    def _forward(
        self, views: dict[str, torch.Tensor], meta: BatchMetadata, backend: GraphDecodeAttention
    ) -> torch.Tensor:
        logits: torch.Tensor = self.model(views["input_ids"], meta, backend, self.kv.layers, None)
        return logits

    def _fixed_meta(self, layout: StagingLayout, views: dict[str, torch.Tensor]) -> BatchMetadata:
        """The metadata the model reads inside the graph: the fixed views (only ``positions``
        is read outside attention, by the rotary embedding)."""
        b = layout.bucket
        return BatchMetadata(
            page_size=self.page_size, qo_indptr=views["kv_indptr"], kv_indptr=views["kv_indptr"],
            kv_indices=views["kv_indices"], kv_last_page_len=views["kv_last_page_len"],
            positions=views["positions"], batch_indices=views["batch_indices"],
            append_pages=views["positions"], append_offsets=views["positions"],
            logits_indices=views["batch_indices"], q_lens=(1,) * b, kv_lens=(1,) * b,
        )  # fmt: skip

    def _padding_step(self, bucket: int) -> tuple[torch.Tensor, BatchMetadata]:
        """A decode step of one real row on the pad page (fill_staging pads the rest)."""
        i32 = torch.int32
        meta = BatchMetadata(
            page_size=self.page_size, qo_indptr=torch.tensor([0, 1], dtype=i32),
            kv_indptr=torch.tensor([0, 1], dtype=i32),
            kv_indices=torch.tensor([self.pad_page], dtype=i32),
            kv_last_page_len=torch.tensor([1], dtype=i32),
            positions=torch.zeros(1, dtype=torch.int64), batch_indices=torch.zeros(1, dtype=i32),
            append_pages=torch.tensor([self.pad_page]), append_offsets=torch.zeros(1),
            logits_indices=torch.zeros(1, dtype=torch.int64), q_lens=(1,), kv_lens=(1,),
        )  # fmt: skip
        return torch.zeros(1, dtype=torch.int64), meta

    # -- replay ----------------------------------------------------------------------------
    def bucket(self, meta: BatchMetadata, logits_indices: torch.Tensor | None) -> int | None:
        """The captured bucket that runs this step, or None (run it eagerly)."""
        if logits_indices is not None or not meta.is_decode_only:
            return None
        bucket = bucket_for(meta.num_seqs, self.buckets)
        if bucket is None or bucket not in self.captured:
            return None
        layout = self.layouts[bucket]
        if meta.kv_indices.numel() + bucket - meta.num_seqs > layout.max_pages:
            return None
        return bucket

    def run(
        self,
        bucket: int,
        input_ids: torch.Tensor,
        meta: BatchMetadata,
        feed: TokenFeed | None = None,
    ) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` of a decode step (host tensors; ``feed``: the tokens
        still on the device) from ``bucket``'s graph; the returned tensor is the graph's and is
        overwritten by the next replay."""
        captured = self.captured[bucket]
        self._stage(captured.layout, (input_ids, meta), captured.backend)
        if feed is not None:
            feed.apply(self.staging[captured.layout.input_ids])
        captured.graph.replay()
        self.replays += 1
        return captured.logits[: meta.num_seqs]

    def _stage(
        self,
        layout: StagingLayout,
        step: tuple[torch.Tensor, BatchMetadata],
        backend: GraphDecodeAttention,
    ) -> None:
        """The step into pinned memory, one copy to the device, then FlashInfer's plan. The
        pinned memory (ours and the plan's) is rewritten only once the device has taken the
        last step's copies: the overlapped step loop stages a step while the last one runs."""
        if self._staged is not None:
            self._staged.synchronize()
        input_ids, meta = step
        used = fill_staging(self.host, layout, input_ids, meta, self.pad_page)
        self.staging[:used].copy_(self.host[:used], non_blocking=True)
        hq, hkv, d = self._heads
        # The step's page indices only (``indptr[-1]`` of them), already in the wrapper's own
        # index buffer: plan's copy of them into it is one of the buffer onto itself.
        indices = self.staging[layout.kv_indices.start : used]
        backend.wrapper.plan(
            self.host[layout.kv_indptr], indices,
            self.host[layout.kv_last_page_len], hq, hkv, d, self.page_size,
            pos_encoding_mode="NONE", q_data_type=self.model.dtype,
            kv_data_type=self.kv.spec.dtype, non_blocking=True,
        )  # fmt: skip
        self._staged = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._staged.record()
