"""ModelRunner: one model replica, its KV pool and attention backend; runs one step's batch.

The runner knows nothing about requests or scheduling: it gets sequences' page tables and new
tokens, validates them, builds the metadata once, and returns logits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu.attention import rope_append
from gpu.attention.backend import AttentionBackend
from gpu.attention.flashinfer_backend import FlashInferPagedAttention
from gpu.attention.metadata import BatchMetadata, SeqChunk, build_batch_metadata
from gpu.attention.torch_backend import TorchPagedAttention
from gpu.config import ModelConfig, ModelError
from gpu.cpu_kernels import CpuKernels
from gpu.graph_runner import DecodeGraphs
from gpu.kv_cache import KVCache, KVCacheSpec
from gpu.lora import LoraAdapter, LoraSet, LoraStep
from gpu.model import CausalLM
from gpu.parallel.launch import RankGroup
from gpu.parallel.step import pack_step
from gpu.pooling import HiddenTap
from gpu.quant import FP8
from gpu.transfers import move, to_device

log = logging.getLogger(__name__)


def make_backend(
    config: ModelConfig,
    device: torch.device,
    kernels: CpuKernels | None = None,
    rope_cache: torch.Tensor | None = None,
) -> AttentionBackend:
    """FlashInfer on CUDA (rotating q and k in its KV append with ``rope_cache``); plain torch
    elsewhere (with the fused decode kernel if given)."""
    if device.type == "cuda":
        return FlashInferPagedAttention(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, device,
            rope_cache=rope_cache,
        )  # fmt: skip
    return TorchPagedAttention(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim, kernels
    )


@dataclass(frozen=True)
class TokenFeed:
    """Input tokens still on the device (the overlapped step loop, ``gpu/overlap.py``): the
    token at flat input position ``positions[i]`` is ``source[rows[i]]``, the previous step's
    sampled tokens; the host's copy of the step holds ``INFLIGHT_TOKEN`` there."""

    source: torch.Tensor
    positions: list[int]
    rows: list[int]

    def apply(self, input_ids: torch.Tensor) -> None:
        """Write the fed tokens into ``input_ids`` (queued on the device: no host wait)."""
        positions = to_device(self.positions, torch.int64, input_ids.device)
        rows = to_device(self.rows, torch.int64, self.source.device)
        input_ids[positions] = self.source[rows].to(input_ids.device, input_ids.dtype)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_pages: int,
        page_size: int = 16,
        backend: AttentionBackend | None = None,
        kv_dtype: torch.dtype | None = None,
        peers: RankGroup | None = None,
        cuda_graphs: bool = False,
        fused_rope_append: bool = False,
    ) -> None:
        """``peers``: the other ranks of a tensor-parallel replica (``model`` is rank 0's
        shard): each step is broadcast to them before it runs here. ``cuda_graphs``: decode
        steps replay CUDA graphs (``gpu/graph_runner.py``) once ``capture_graphs`` has run;
        only on one CUDA device with the FlashInfer backend, ignored elsewhere (the pool
        then gets one pad page more for the graphs' padding rows). ``fused_rope_append``: on
        CUDA with fp16/bf16 pages and Triton, one kernel rotates q and k and appends k and v
        (``gpu/attention/rope_append.py``), eager and in the graphs; ignored off CUDA."""
        self.model = model
        self.config = model.config
        self.device = model.device
        self.peers = peers
        # This rank's heads: a tensor-parallel shard's pool holds only its KV heads.
        local = model.local_config
        spec = KVCacheSpec.for_model(local, num_pages, page_size, kv_dtype or model.dtype)
        # The fused decode-attention kernel reads fp32 queries and an fp32 cache.
        fp32 = model.dtype == torch.float32 and spec.dtype == torch.float32
        kernels = model.kernels if fp32 else None
        if backend is None and spec.dtype == FP8 and self.device.type != "cuda":
            # fp8 pages off CUDA: the torch backend (converted on append and gather); on CUDA
            # FlashInfer attends over them directly (bf16 queries, e4m3 pages).
            backend = TorchPagedAttention(
                local.num_attention_heads, local.num_key_value_heads, local.head_dim
            )
        rope_cache = None
        if fused_rope_append and backend is None and self.device.type == "cuda":
            rope_cache = model.rope.cos_sin_cache
            if spec.dtype not in rope_append.DTYPES or not rope_append.available():
                log.warning("fused rotary + KV append needs Triton and fp16/bf16 pages "
                            "(%s here): rotating separately", spec.dtype)  # fmt: skip
                rope_cache = None
        self.backend = backend or make_backend(local, self.device, kernels, rope_cache)
        self.cuda_graphs = (
            cuda_graphs
            and self.device.type == "cuda"
            and peers is None
            and isinstance(self.backend, FlashInferPagedAttention)
        )
        if self.cuda_graphs and self.config.moe is not None:
            # the experts' token counts are read on the host each layer: not capturable
            log.warning("a mixture-of-experts model decodes eagerly (no CUDA graphs)")
            self.cuda_graphs = False
        self.kv = KVCache(spec, self.device, pad_pages=1 if self.cuda_graphs else 0)
        self.graphs: DecodeGraphs | None = None
        self.loras = LoraSet([])  # the LoRA adapters sequences name by slot (``load_loras``)

    def load_loras(self, loras: LoraSet) -> None:
        """Serve these adapters (moved to the model's device and dtype)."""
        self.loras = LoraSet([])
        for adapter in loras.adapters:
            self.add_lora(adapter)

    def add_lora(self, adapter: LoraAdapter) -> None:
        """Serve one more adapter, at run time (between steps or during one: a step reads
        only the slots its sequences hold)."""
        if self.peers is not None:
            raise ModelError("LoRA adapters are not supported with tensor parallelism")
        self.loras.add(adapter.to(self.device, self.model.dtype))

    def capture_graphs(self, max_num_seqs: int) -> float | None:
        """Capture the decode graphs for batches up to ``max_num_seqs`` (the warm-up does);
        the seconds it took, or None where this runner decodes eagerly."""
        if not self.cuda_graphs or not isinstance(self.backend, FlashInferPagedAttention):
            return None
        spec = self.kv.spec
        graphs = DecodeGraphs(
            self.model, self.kv, pad_page=spec.num_pages, max_num_seqs=max_num_seqs,
            max_seq_len=min(self.max_model_len, spec.num_tokens),
            decode_tensor_cores=self.backend.decode_tensor_cores,
            rope_cache=self.backend.rope_cache,
        )  # fmt: skip
        seconds = graphs.capture()
        self.graphs = graphs
        return seconds

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel replica (nothing on one device)."""
        if self.peers is not None:
            self.peers.close()

    @property
    def page_size(self) -> int:
        return self.kv.spec.page_size

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    def check_prompt(self, token_ids: Sequence[int]) -> None:
        """Raise ``ModelError`` for a prompt the model cannot take."""
        if len(token_ids) > self.max_model_len:
            raise ModelError(
                f"prompt has {len(token_ids)} tokens; the model's context length is "
                f"{self.max_model_len}"
            )
        self.check_token_ids(token_ids)

    def check_token_ids(self, token_ids: Sequence[int]) -> None:
        vocab = self.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ModelError(f"token ids out of range [0, {vocab}): {bad[:5]}")

    def execute(
        self,
        chunks: list[SeqChunk],
        new_tokens: Sequence[Sequence[int]],
        all_logits: bool = False,
        num_logits: Sequence[int] | None = None,
        feed: TokenFeed | None = None,
        tap: HiddenTap | None = None,
    ) -> torch.Tensor:
        """Run one forward pass; logits of each sequence's last new token ``[B, V]``, or of
        every new token ``[T, V]`` when ``all_logits`` (tests), or of each sequence's last
        ``num_logits[b]`` new tokens, concatenated in batch order (speculative verification:
        the last real token and the drafts after it; the lm_head runs on those rows only).
        ``feed``: the tokens ``new_tokens`` holds as ``INFLIGHT_TOKEN``, on the device.
        ``tap``: rows whose final hidden states to hand back too (``gpu.pooling``)."""
        flat: list[int] = []
        for chunk, tokens in zip(chunks, new_tokens, strict=True):
            if len(tokens) != chunk.num_new:
                raise ValueError(f"chunk expects {chunk.num_new} tokens, got {len(tokens)}")
            if chunk.kv_len > self.max_model_len:
                raise ModelError(
                    f"sequence of {chunk.kv_len} tokens exceeds the context length "
                    f"{self.max_model_len}"
                )
            flat.extend(tokens)
        if feed is not None:
            if self.peers is not None:
                raise ValueError("a tensor-parallel step sends its tokens: none may be in flight")
            for position in feed.positions:
                flat[position] = 0  # (checked on the device's side: the sampler drew it)
        self.check_token_ids(flat)
        meta = build_batch_metadata(chunks, self.page_size)
        indices = None
        if num_logits is not None and not all_logits:
            indices = _trailing_indices(chunks, num_logits)
        input_ids = torch.tensor(flat, dtype=torch.int64)
        lora = None
        if any(chunk.adapter for chunk in chunks):
            if max(chunk.adapter for chunk in chunks) > len(self.loras.adapters):
                raise ValueError("a sequence names a LoRA slot this runner does not have")
            lora = self.loras.step(
                [c.adapter for c in chunks], [c.num_new for c in chunks], self.device
            )
        return self.forward(input_ids, meta, all_logits, indices, feed, lora, tap)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: BatchMetadata,
        all_logits: bool = False,
        logits_indices: torch.Tensor | None = None,
        feed: TokenFeed | None = None,
        lora: LoraStep | None = None,
        tap: HiddenTap | None = None,
    ) -> torch.Tensor:
        if self.peers is None:
            return self._forward(input_ids, meta, all_logits, logits_indices, feed, lora, tap)
        self.peers.send_step(pack_step(input_ids, meta, all_logits, logits_indices))
        try:  # (the tap is rank 0's alone: every rank holds the whole hidden state)
            return self._forward(input_ids, meta, all_logits, logits_indices, tap=tap)
        except BaseException as exc:
            self.peers.mark_failed(exc)
            raise

    def _forward(
        self,
        input_ids: torch.Tensor,
        meta: BatchMetadata,
        all_logits: bool,
        logits_indices: torch.Tensor | None,
        feed: TokenFeed | None = None,
        lora: LoraStep | None = None,
        tap: HiddenTap | None = None,
    ) -> torch.Tensor:
        # (never with peers: no TP graphs; a step with LoRA rows or a tap runs eagerly)
        if self.graphs is not None and not all_logits and lora is None and tap is None:
            bucket = self.graphs.bucket(meta, logits_indices)
            if bucket is not None:
                return self.graphs.run(bucket, input_ids, meta, feed)
        if self.device.type != "cpu":  # (through pinned memory: no copy waits for the stream)
            meta = meta.to(self.device)
            input_ids = move(input_ids, self.device)
            if logits_indices is not None:
                logits_indices = move(logits_indices, self.device)
            if tap is not None:
                tap.to(self.device)
        if feed is not None:
            feed.apply(input_ids)
        self.backend.plan(meta)
        indices = None if all_logits else meta.logits_indices
        if logits_indices is not None:
            indices = logits_indices
        logits: torch.Tensor = self.model(
            input_ids, meta, self.backend, self.kv.layers, indices, lora, tap
        )
        return logits


def _trailing_indices(chunks: list[SeqChunk], num_logits: Sequence[int]) -> torch.Tensor:
    """Flat token indices of each chunk's last ``num_logits[b]`` new tokens."""
    if len(num_logits) != len(chunks):
        raise ValueError(f"num_logits has {len(num_logits)} entries for {len(chunks)} sequences")
    indices: list[int] = []
    end = 0
    for chunk, n in zip(chunks, num_logits, strict=True):
        end += chunk.num_new
        if not 1 <= n <= chunk.num_new:
            raise ValueError(f"num_logits {n} is outside [1, {chunk.num_new}]")
        indices.extend(range(end - n, end))
    return torch.tensor(indices, dtype=torch.int64)
