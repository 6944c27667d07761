"""A Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, and the mixture-of-experts
Mixtral, Qwen2-MoE and Qwen3-MoE: ``gpu.moe``) over a paged KV cache.

The forward pass takes one flat batch of new tokens from many sequences (prompt chunks and
decodes mixed) described by ``BatchMetadata``; attention goes through an ``AttentionBackend``
so the same model runs on plain torch (CPU) or FlashInfer (CUDA). q/k/v and gate/up are fused
into one matmul each at load time: fewer, larger matmuls per layer.

Linear layers come from ``gpu.linear.make_linear`` in the chosen weight format (fp32/bf16,
int8, int4, a GGUF file's own blocks, fp8); a tied embedding reads its rows from the LM head,
so each weight is held in one form only; norms, rotary and SwiGLU go through ``gpu.ops``
(plain torch, or fused CPU kernels). The residual stream is one tensor updated in place:
each layer returns its MLP output, which the next layer's input norm adds in (vLLM's fused
add + RMSNorm).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from gpu.attention.backend import AttentionBackend
from gpu.attention.metadata import BatchMetadata
from gpu.attention.torch_backend import TorchPagedAttention
from gpu.config import ModelConfig, ModelError, MoeConfig
from gpu.cpu_kernels import CpuKernels, FusedDecoder
from gpu.cpu_kernels.decoder import DecoderShape, LayerWeights, ReduceFailed
from gpu.linear import DenseLinear, Linear, blocks_run_on, make_linear
from gpu.lora import LoraStep
from gpu.moe import SparseMoe
from gpu.ops import RopeStep, TorchOps, make_ops
from gpu.parallel.group import TensorParallel
from gpu.parallel.shard import shard_config, shard_weights
from gpu.pooling import HiddenTap
from gpu.quant import BlockWeight
from gpu.rope import RotaryEmbedding

Weight = torch.Tensor | BlockWeight
EMBEDDING = "model.embed_tokens.weight"


def stacked(parts: list[Weight]) -> Weight:
    """Weights stacked along N (q/k/v, gate/up): blocks stay blocks where every part has the
    same type, else everything is dequantized (fp32)."""
    if all(isinstance(p, BlockWeight) for p in parts):
        blocks = BlockWeight.cat([p for p in parts if isinstance(p, BlockWeight)])
        if blocks is not None:
            return blocks
    return torch.cat([p.dequantize() if isinstance(p, BlockWeight) else p for p in parts])


def stays_blocks(
    name: str, weight: Weight, device: torch.device, dtype: torch.dtype, config: ModelConfig
) -> bool:
    """Whether a weight read as GGUF blocks is kept so on ``device``: where the CPU kernels or
    CUDA's Triton block matmul run them (``blocks_run_on``), except an untied embedding off
    the CPU (read by rows, never multiplied: it is dequantized to the model's dtype there).
    Everything else is dequantized at load."""
    if not isinstance(weight, BlockWeight) or not blocks_run_on(device, dtype):
        return False
    return device.type == "cpu" or name != EMBEDDING or config.tie_word_embeddings


def dense(weight: Weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, BlockWeight) else weight


def owned(weight: Weight) -> nn.Parameter:
    """A tensor kept as it was read, in memory of its own: safetensors hands out views of the
    file's mapping, and one norm vector kept as such a view keeps the whole mapping resident
    (513 MB on the default model, every page of it touched by the load)."""
    return nn.Parameter(dense(weight).clone(), requires_grad=False)


class DeviceWeights(Mapping[str, Weight]):
    """The checkpoint's tensors, each moved to the model's device and dtype as it is read.

    Why not all at once: a layer that quantizes its weight (int8, int4, fp8) frees the moved
    full-precision copy as soon as it is built, so loading peaks at the quantized model plus
    one layer's tensors, not every tensor at full precision (a Mixtral-8x7B in bf16, 93 GB,
    before its int8 form of 47 GB). On the CPU in fp32 a tensor is not copied at all."""

    def __init__(
        self, weights: dict[str, Weight], device: torch.device, dtype: torch.dtype,
        config: ModelConfig,
    ) -> None:  # fmt: skip
        self._weights = dict(weights)
        self._device, self._dtype, self._config = device, dtype, config

    def __getitem__(self, name: str) -> Weight:
        t = self._weights[name]
        if stays_blocks(name, t, self._device, self._dtype, self._config):
            return t.to(self._device)
        return dense(t).to(device=self._device, dtype=self._dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def pop(self, name: str) -> Weight:
        weight = self[name]
        del self._weights[name]
        return weight


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        w: Mapping[str, Weight],
        prefix: str,
        linear: Callable[..., Linear],
        ops: TorchOps,
        tp: TensorParallel | None = None,
        row_amax: dict[str, torch.Tensor] | None = None,
        index: int = 0,
    ) -> None:
        """``index``: the layer's place in the model (where a LoRA adapter's pairs for it
        are). ``config``: this rank's shapes (``gpu.parallel.shard_config``); with ``tp``, ``w``
        holds this rank's share of each weight and ``row_amax`` the whole rows' magnitudes
        of its row-parallel ones (``gpu.parallel.shard.ShardedWeights``)."""
        super().__init__()
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        amax = row_amax or {}
        self.tp = tp
        self.index = index
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat([dense(w[f"{attn}.{n}_proj.bias"]) for n in ("q", "k", "v")])
        self.qkv_proj = linear(
            stacked([w[f"{attn}.{n}_proj.weight"] for n in ("q", "k", "v")]), qkv_bias
        )
        o, down = f"{attn}.o_proj.weight", f"{mlp}.down_proj.weight"
        self.o_proj = linear(w[o], row_amax=amax.get(o))
        # A mixture-of-experts layer has no dense gate_up_proj / down_proj.
        self.moe: SparseMoe | None = None
        if config.moe is not None and config.sparse_layer(index):
            self.moe = SparseMoe(config.moe, w, index, linear, ops, stacked, owned, amax)
        else:
            self.gate_up_proj = linear(
                stacked([w[f"{mlp}.gate_proj.weight"], w[f"{mlp}.up_proj.weight"]])
            )
            self.down_proj = linear(w[down], row_amax=amax.get(down))
        self.input_norm = owned(w[f"{prefix}.input_layernorm.weight"])
        self.post_attn_norm = owned(w[f"{prefix}.post_attention_layernorm.weight"])
        # Qwen3: each q and k head RMS-normalised before the rotary
        self.q_norm: nn.Parameter | None = None
        self.k_norm: nn.Parameter | None = None
        if config.qk_norm:
            self.q_norm = owned(w[f"{attn}.q_norm.weight"])
            self.k_norm = owned(w[f"{attn}.k_norm.weight"])
        self.ops = ops
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.head_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]

    def __call__(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        rope: RopeStep,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        # Called 30x a step: skip nn.Module's hook dispatch (the runtime registers no hooks).
        return self.forward(hidden, delta, rope, backend, kv_cache, lora)

    def forward(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        rope: RopeStep,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """Adds ``delta`` (the previous layer's output) into ``hidden`` in place; returns this
        layer's MLP output, to be added in by the next layer (or the final norm). ``lora``:
        the step's adapters, each linear's update added on their rows."""
        t, d, ops = hidden.shape[0], self.head_dim, self.ops
        x = ops.add_rms_norm(hidden, delta, self.input_norm, self.eps)
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.add_(self.index, "qkv", x, qkv)
        self._qk_norm_(qkv)
        if not backend.rotates_qk:  # else fused into the backend's KV append
            ops.rope_(qkv, self.num_heads + self.num_kv_heads, d, rope)
        q, k, v = torch.split_with_sizes(qkv.view(t, -1, d), self.head_split, dim=1)
        attn = backend.attend(q, k, v, kv_cache).reshape(t, self.q_size)
        attn_out = self.o_proj(attn)
        if lora is not None:
            lora.add_(self.index, "o", attn, attn_out)
        if self.tp is not None:
            self.tp.all_reduce_(attn_out)
        x = ops.add_rms_norm(hidden, attn_out, self.post_attn_norm, self.eps)
        if self.moe is not None:
            out = self.moe(x)
        else:
            gate_up = self.gate_up_proj(x)
            if lora is not None:
                lora.add_(self.index, "gate_up", x, gate_up)
            act = ops.silu_mul(gate_up)
            out = self.down_proj(act)
            if lora is not None:
                lora.add_(self.index, "down", act, out)
        if self.tp is not None:
            self.tp.all_reduce_(out)
        return out

    def forward_few_rows(
        self,
        hidden: torch.Tensor,
        rope: RopeStep,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
    ) -> None:
        """The layer for a step of a few tokens (``CausalLM.use_triton_gemv(rows,
        fuse_layers=True)``): each norm, the SiLU and both residual adds are done inside the
        matmuls (``gpu.triton_gemv.gemv``), so the layer launches its four matmuls, the
        rotary and the attention; ``hidden`` is the whole residual stream, updated in place."""
        from gpu.triton_gemv import gemv

        t, d, eps = hidden.shape[0], self.head_dim, self.eps
        qkv_proj, o_proj = cast(DenseLinear, self.qkv_proj), cast(DenseLinear, self.o_proj)
        gate_up, down = cast(DenseLinear, self.gate_up_proj), cast(DenseLinear, self.down_proj)
        qkv = gemv(hidden, qkv_proj.weight, qkv_proj.bias, norm=self.input_norm, eps=eps)
        self._qk_norm_(qkv)
        if not backend.rotates_qk:
            self.ops.rope_(qkv, self.num_heads + self.num_kv_heads, d, rope)
        q, k, v = torch.split_with_sizes(qkv.view(t, -1, d), self.head_split, dim=1)
        attn = backend.attend(q, k, v, kv_cache)
        gemv(attn.reshape(t, self.q_size), o_proj.weight, o_proj.bias, add_to=hidden)
        mlp_in = gemv(hidden, gate_up.weight, gate_up.bias, norm=self.post_attn_norm, eps=eps)
        gemv(mlp_in, down.weight, down.bias, silu=True, add_to=hidden)

    def _qk_norm_(self, qkv: torch.Tensor) -> None:
        if self.q_norm is not None and self.k_norm is not None:
            self.ops.qk_norm_(
                qkv, self.q_norm, self.k_norm, self.num_heads, self.num_kv_heads, self.eps
            )

    def fused_weights(self) -> LayerWeights | None:
        """This layer for ``FusedDecoder``, where every linear has a CPU kernel (a mixture of
        experts: its one-call MLP)."""
        qkv, o = self.qkv_proj.packed(), self.o_proj.packed()
        q_norm, k_norm = (None if n is None else n.data for n in (self.q_norm, self.k_norm))
        norms = (self.input_norm.data, self.post_attn_norm.data)
        if qkv is None or o is None:
            return None
        if self.moe is not None:
            moe = self.moe.packed()
            if moe is None:
                return None
            return LayerWeights(*norms, qkv, o, None, None, q_norm, k_norm, moe)
        gate_up, down = self.gate_up_proj.packed(), self.down_proj.packed()
        if gate_up is None or down is None:
            return None
        return LayerWeights(*norms, qkv, o, gate_up, down, q_norm, k_norm)


class CausalLM(nn.Module):
    """Token ids in, logits out; the KV cache and attention backend are passed per call.

    ``quantization`` (``none`` | ``int8`` | ``int4`` | ``gguf`` | ``fp8``) picks the format of
    every linear layer, the LM head included (``weights`` may hold GGUF blocks,
    ``gpu.quant.BlockWeight``, which ``gguf`` keeps as they are); ``kernels`` (CPU only)
    switches the decoder's small ops and matmuls to the fused kernels of ``gpu.cpu_kernels``.
    ``tp`` (``gpu.parallel``): this model is one rank's share of a tensor-parallel replica
    (its heads, its slice of each MLP and of the vocabulary; one all-reduce after each
    row-parallel layer, the logits gathered on rank 0); ``config`` stays the whole model's
    and ``local_config`` has this rank's shapes (its KV pool and attention use those).
    With kernels, a step whose tokens are all decodes runs every layer in one C call
    (``FusedDecoder``; same bits, no per-op Python); ``fuse_decode = False`` keeps the per-op
    path (tests, benchmarks).
    """

    fuse_decode = True
    # Steps of at most this many tokens run ``DecoderLayer.forward_few_rows`` (0: none).
    few_row_layers = 0

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Weight],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        quantization: str = "none",
        kernels: CpuKernels | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        check_weights(config, weights)
        if tp is not None and tp.world == 1:
            tp = None
        self.tp = tp
        self.local_config = config if tp is None else shard_config(config, tp.world)
        row_amax: dict[str, torch.Tensor] = {}
        if tp is not None:  # this rank's slices (only they move to the device below)
            scaled_per_row = quantization in ("int8", "fp8")
            sharded = shard_weights(
                config, weights, tp.shard, row_amax=scaled_per_row,
                keep_blocks=quantization in ("gguf", "auto"),
            )  # fmt: skip
            weights, row_amax = sharded.weights, sharded.row_amax
            self.vocab_start = tp.shard.vocab_range(config.vocab_size)[0]
        device = torch.device(device)
        if device.type != "cpu":
            kernels = None
        w = DeviceWeights(weights, device, dtype, config)
        self.config = config
        self.quantization = quantization
        self.kernels = kernels
        self.ops = make_ops(kernels, device)
        linear = partial(make_linear, quantization=quantization, kernels=kernels, dtype=dtype)
        self.norm = owned(w["model.norm.weight"])
        # Tied: the embedding is the LM head's weight, in the head's format (read by rows).
        self.embed_tokens: nn.Parameter | None = None
        if not config.tie_word_embeddings:
            self.embed_tokens = owned(w.pop("model.embed_tokens.weight"))
        self.layers = nn.ModuleList(
            DecoderLayer(
                self.local_config, w, f"model.layers.{i}", linear, self.ops, tp, row_amax, i
            )
            for i in range(config.num_hidden_layers)
        )
        head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head = linear(head, lm_head=True)
        self.rope = RotaryEmbedding(config, device, dtype)
        self._fused: FusedDecoder | None = None
        self._fused_built = False

    def _apply(self, *args: Any, **kwargs: Any) -> CausalLM:
        # .to() / .float() and friends may replace the tensors the fused table points at.
        self._fused, self._fused_built = None, False
        model: CausalLM = super()._apply(*args, **kwargs)  # type: ignore[no-untyped-call]
        return model

    def fused_decoder(self) -> FusedDecoder | None:
        """The one-call decode step, where the CPU kernels cover every layer (built once)."""
        if not self._fused_built:
            self._fused_built = True
            layers = [cast(DecoderLayer, layer).fused_weights() for layer in self.layers]
            c = self.local_config
            if self.kernels is not None and self.dtype == torch.float32 and all(layers):
                shape = DecoderShape(
                    c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                    c.intermediate_size, c.rms_norm_eps,
                )  # fmt: skip
                hook = (0, 0) if self.tp is None else self.tp.reduce_hook()
                self._fused = self.kernels.fused_decoder(shape, [w for w in layers if w], hook)
        return self._fused

    def use_triton_gemv(self, rows: int, fuse_layers: bool = False) -> int:
        """Steps of at most ``rows`` tokens run their dense fp16/bf16 CUDA linears through
        ``gpu.triton_gemv`` instead of cuBLAS (0: none do); returns how many linears switched.
        ``fuse_layers``: such steps also fold the norms, the SiLU and the residual adds into
        those matmuls (``DecoderLayer.forward_few_rows``); every linear must switch. Off
        unless called (the executor's ``--triton-gemv``, the GPU check's modes)."""
        from gpu.triton_gemv import DTYPES, MAX_ROWS

        if rows > MAX_ROWS:
            raise ValueError(f"the Triton matrix-vector kernel takes at most {MAX_ROWS} rows")
        switched = 0
        grouped = {  # experts that run as gpu.triton_moe's grouped matmuls: left as they are
            id(linear)
            for layer in cast(list[DecoderLayer], list(self.layers))
            if layer.moe is not None and layer.moe.stacked_gate_up is not None
            for linear in layer.moe.modules()
        }
        for module in self.modules():
            if not isinstance(module, DenseLinear) or module.layout != "nk":
                continue
            if id(module) in grouped:
                continue
            if module.weight.dtype in DTYPES:
                module.triton_rows = rows
                switched += 1
        self.few_row_layers = 0
        if fuse_layers and rows:
            if self.config.moe is not None:
                self.use_triton_gemv(0)
                raise ValueError("fused few-row layers do not take a mixture of experts")
            if switched != 4 * len(self.layers) + 1 or self.tp is not None:
                self.use_triton_gemv(0)
                raise ValueError(
                    "fused few-row layers need every linear dense fp16/bf16 in CUDA's layout, "
                    f"on one device ({switched} of {4 * len(self.layers) + 1} linears are)"
                )
            self.few_row_layers = rows
        return switched

    def warm_triton_gemv(self) -> int:
        """Run every Triton matrix-vector variant a step of a few tokens can launch (each
        linear's shape plain; with ``few_row_layers`` the layers' norm, residual and SiLU
        ones, the head's normed and plain ones), once at each row block (1, 2, 4, 8 up to
        the limit), on zeros: compiled and, on CUDA, tuned before the first request needs
        them (the warm-up). Returns how many calls it made."""
        from gpu.triton_gemv import gemv, row_blocks

        linears = [m for m in self.modules() if isinstance(m, DenseLinear) and m.triton_rows]
        rows = max((m.triton_rows for m in linears), default=0)  # (few_row_layers: the same)
        if self.few_row_layers:  # the layers' linears take the fused variants only; the
            # head's plain one serves a longer step's logits rows (at most 8 of them)
            linears = [m for m in linears if m is self.lm_head]
        variants: dict[tuple[int, int, bool, str], DenseLinear] = {}
        for dense_linear in linears:
            shape = (dense_linear.out_features, dense_linear.in_features)
            variants.setdefault((*shape, dense_linear.bias is not None, ""), dense_linear)
        if self.few_row_layers:
            layer = cast(DecoderLayer, self.layers[0])
            for linear, kind in (
                (layer.qkv_proj, "norm"), (layer.o_proj, "add"), (layer.gate_up_proj, "norm"),
                (layer.down_proj, "silu_add"), (self.lm_head, "norm"),
            ):  # fmt: skip
                key = (linear.out_features, linear.in_features, linear.bias is not None, kind)
                variants.setdefault(key, cast(DenseLinear, linear))
        calls = 0
        for m in row_blocks(rows):  # (the kernel is compiled per row block)
            for (n, k, _, kind), linear in variants.items():
                w, b = linear.weight, linear.bias
                x = torch.zeros(
                    (m, 2 * k if kind == "silu_add" else k), dtype=w.dtype, device=w.device
                )
                norm = torch.ones(k, dtype=w.dtype, device=w.device) if kind == "norm" else None
                out = torch.zeros((m, n), dtype=w.dtype, device=w.device) if "add" in kind else None
                gemv(x, w, b, norm=norm, silu=kind == "silu_add", add_to=out)
                calls += 1
        return calls

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, H]`` embeddings in the model dtype."""
        if self.tp is not None:  # this rank's vocabulary rows; the others' add in
            local = input_ids - self.vocab_start
            held = (local >= 0) & (local < self.lm_head.out_features)
            rows = self._rows(local.clamp(0, self.lm_head.out_features - 1))
            rows = rows * held.unsqueeze(1).to(rows.dtype)
            self.tp.all_reduce_(rows)
            return rows
        return self._rows(input_ids)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return F.embedding(ids, self.embed_tokens)
        return self.lm_head.rows(ids).to(self.dtype).contiguous()

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: BatchMetadata,
        backend: AttentionBackend,
        kv_layers: list[torch.Tensor],
        logits_indices: torch.Tensor | None = None,
        lora: LoraStep | None = None,
        tap: HiddenTap | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` (every token's when ``logits_indices`` is None).

        ``backend.plan(meta)`` must have been called for this step. ``lora``: the step's LoRA
        adapters and their rows (``gpu.lora``); such a step takes the per-op path. ``tap``:
        rows whose final hidden states (after the final norm) are handed back in ``tap.rows``
        (``gpu.pooling``).
        """
        if lora is not None and self.tp is not None:
            raise ModelError("LoRA adapters are not supported with tensor parallelism")
        hidden = self.embed(input_ids)
        rope = self.ops.rope_step(self.rope, meta.positions)
        if 0 < hidden.shape[0] <= self.few_row_layers and lora is None:
            return self._forward_few_rows(hidden, rope, backend, kv_layers, logits_indices, tap)
        decodes = backend.decode_only() if isinstance(backend, TorchPagedAttention) else None
        fused = None
        if decodes is not None and self.fuse_decode and lora is None:
            fused = self.fused_decoder()
        delta: torch.Tensor | None = None
        if fused is not None and decodes is not None and rope.cos.dim() == 2:
            try:
                delta = fused(hidden, rope.positions, rope.cos, rope.sin, decodes, kv_layers)
            except ReduceFailed as exc:
                assert self.tp is not None  # only a split replica's decoder has the hook
                raise self.tp.lost(exc) from exc
        else:
            for layer, kv_cache in zip(self.layers, kv_layers, strict=True):
                delta = layer(hidden, delta, rope, backend, kv_cache, lora)
        if tap is not None:  # (gathered copies: the rows below still add delta themselves)
            rows = None if delta is None else delta[tap.indices]
            tap.rows = self.ops.add_rms_norm(
                hidden[tap.indices], rows, self.norm, self.config.rms_norm_eps
            )
        if logits_indices is not None:
            hidden = hidden[logits_indices]
            delta = None if delta is None else delta[logits_indices]
        hidden = self.ops.add_rms_norm(hidden, delta, self.norm, self.config.rms_norm_eps)
        logits: torch.Tensor = self.lm_head(hidden).float()
        if self.tp is not None:
            gathered = self.tp.gather_vocab(logits, self.config.vocab_size)
            return logits[:, :0] if gathered is None else gathered  # ranks > 0: no logits
        return logits

    def _forward_few_rows(
        self,
        hidden: torch.Tensor,
        rope: RopeStep,
        backend: AttentionBackend,
        kv_layers: list[torch.Tensor],
        logits_indices: torch.Tensor | None,
        tap: HiddenTap | None = None,
    ) -> torch.Tensor:
        from gpu.triton_gemv import gemv

        for layer, kv_cache in zip(self.layers, kv_layers, strict=True):
            cast(DecoderLayer, layer).forward_few_rows(hidden, rope, backend, kv_cache)
        if tap is not None:  # (hidden is the whole residual here: the layers added in place)
            tap.rows = self.ops.add_rms_norm(
                hidden[tap.indices], None, self.norm, self.config.rms_norm_eps
            )
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        head = cast(DenseLinear, self.lm_head)
        eps = self.config.rms_norm_eps
        return gemv(hidden, head.weight, head.bias, norm=self.norm, eps=eps).float()


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape (HF names)."""
    h, d = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (config.num_attention_heads * d, h)
        shapes[f"{p}.self_attn.k_proj.weight"] = (config.num_key_value_heads * d, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (config.num_key_value_heads * d, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, config.num_attention_heads * d)
        if config.moe is not None and config.sparse_layer(i):
            shapes.update(moe_shapes(config.moe, i, h))
        else:
            shapes[f"{p}.mlp.gate_proj.weight"] = (config.intermediate_size, h)
            shapes[f"{p}.mlp.up_proj.weight"] = (config.intermediate_size, h)
            shapes[f"{p}.mlp.down_proj.weight"] = (h, config.intermediate_size)
        if config.qk_norm:
            shapes[f"{p}.self_attn.q_norm.weight"] = (d,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (d,)
        if config.qkv_bias:
            shapes[f"{p}.self_attn.q_proj.bias"] = (config.num_attention_heads * d,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (config.num_key_value_heads * d,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (config.num_key_value_heads * d,)
    return shapes


def moe_shapes(moe: MoeConfig, layer: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The tensors of one mixture-of-experts layer's MLP, with their shapes."""
    shapes: dict[str, tuple[int, ...]] = {moe.router(layer): (moe.num_experts, hidden)}
    size = moe.intermediate_size
    for e in range(moe.num_experts):
        gate, up, down = moe.expert(layer, e)
        shapes |= {gate: (size, hidden), up: (size, hidden), down: (hidden, size)}
    if moe.shared_intermediate_size:
        gate, up, down, shared_gate = moe.shared(layer)
        size = moe.shared_intermediate_size
        shapes |= {gate: (size, hidden), up: (size, hidden), down: (hidden, size)}
        shapes[shared_gate] = (1, hidden)
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, Weight]) -> None:
    """Raise ``ModelError`` naming missing tensors or tensors whose shape does not match."""
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(weights))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelError(f"checkpoint is missing tensors: {', '.join(missing[:5])}{more}")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise ModelError(
                f"tensor {name} has shape {tuple(weights[name].shape)}, config expects {shape}"
            )
