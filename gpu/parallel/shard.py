"""Which part of the model a tensor-parallel rank holds (Megatron-style splits).

Per decoder layer, q/k/v and gate/up are split by output rows (column-parallel: each rank
computes its own heads and its own slice of the MLP), o_proj and down_proj by input columns
(row-parallel: each rank's partial sums are added by one all-reduce). The embedding and the LM
head are split by vocabulary rows. Splits are even; the head counts must divide:

- query heads by the world size;
- KV heads by the world size, or the world size by the KV heads: then each KV head is held
  (replicated) by ``world / kv_heads`` ranks, whose query heads all read it.

A mixture of experts is split the same way inside each expert (gate/up by rows, down by
columns, over each expert's intermediate size); the router stays whole on every rank.

Row-parallel weights are sliced too, and each row's largest magnitude over the whole row is
kept beside the slice (``row_amax``): int8 and fp8 take their per-row scales from it, so
every rank multiplies by exactly the codes and scales of the unsplit layer (the result is
the unsplit one's bits only where each rank's share of the intermediate size, an expert's
included, is a multiple of 32: the CPU kernels quantize activations, and int4 pads its
weights, in blocks of 32); GGUF blocks split
on their 32-weight boundaries (other splits are refused). Only slices move to the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from gpu.config import ModelConfig, ModelError, MoeConfig
from gpu.quant import BlockWeight, block_columns

Weight = torch.Tensor | BlockWeight


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world`` in a tensor-parallel group."""

    rank: int
    world: int

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world}")

    def part(self, n: int) -> tuple[int, int]:
        """This rank's even share ``[start, stop)`` of ``n`` (which the world size divides)."""
        size = n // self.world
        return self.rank * size, (self.rank + 1) * size

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        """This rank's rows of a vocabulary split in ``ceil(vocab / world)`` rows per rank
        (the last rank's share may be shorter)."""
        per = -(-vocab // self.world)
        return min(vocab, self.rank * per), min(vocab, (self.rank + 1) * per)

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """The KV heads this rank holds (one replicated head when there are fewer than ranks)."""
        if num_kv_heads >= self.world:
            return self.part(num_kv_heads)
        head = self.rank * num_kv_heads // self.world
        return head, head + 1


def check_tensor_parallel(config: ModelConfig, world: int) -> None:
    """Raise ``ModelError`` where ``config``'s shapes cannot be split ``world`` ways."""
    if world < 1:
        raise ModelError("tensor-parallel size must be >= 1")
    if world == 1:
        return
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if hq % world:
        problems.append(f"{hq} attention heads")
    if hkv % world and world % hkv:
        problems.append(f"{hkv} KV heads (neither divides the other)")
    dense = [i for i in range(config.num_hidden_layers) if not config.sparse_layer(i)]
    if dense and config.intermediate_size % world:
        problems.append(f"intermediate size {config.intermediate_size}")
    if config.moe is not None:
        for what, size in (("expert", config.moe.intermediate_size),
                           ("shared expert", config.moe.shared_intermediate_size)):  # fmt: skip
            if size % world:
                problems.append(f"{what} intermediate size {size}")
    if problems:
        raise ModelError(
            f"{config.name} cannot be split {world} ways by tensor parallelism: "
            f"{', '.join(problems)} not divisible by {world}"
        )


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The shapes one rank's layers and KV pool have (head_dim fixed: hidden stays whole)."""
    check_tensor_parallel(config, world)
    moe = config.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe,
            intermediate_size=moe.intermediate_size // world,
            shared_intermediate_size=moe.shared_intermediate_size // world,
        )
    return dataclasses.replace(
        config,
        moe=moe,
        num_attention_heads=config.num_attention_heads // world,
        num_key_value_heads=max(1, config.num_key_value_heads // world),
        intermediate_size=config.intermediate_size // world,
        head_dim_override=config.head_dim,
    )


def rows(weight: Weight, start: int, stop: int) -> Weight:
    """Output rows ``[start, stop)`` of a weight or bias, in its own format."""
    if isinstance(weight, BlockWeight):
        return weight.row_slice(start, stop)
    return weight[start:stop].contiguous()


@dataclass
class ShardedWeights:
    """One rank's tensors (by checkpoint name) and, for each row-parallel weight that is not
    in blocks, the largest magnitude of each of its whole rows."""

    weights: dict[str, Weight]
    row_amax: dict[str, torch.Tensor]


def shard_weights(
    config: ModelConfig,
    weights: dict[str, Weight],
    shard: Shard,
    row_amax: bool = True,
    keep_blocks: bool = True,
) -> ShardedWeights:
    """This rank's share of every split tensor; norms stay whole. ``row_amax``: keep the whole
    rows' magnitudes of the row-parallel weights (only int8 and fp8 read them; each is a pass
    over the whole weight). ``keep_blocks``: GGUF blocks split as blocks (the ``gguf``
    format); else they are dequantized first, so any split the shapes allow works and int8
    and fp8 take whole-row scales (a mixture of experts' GGUF experts under other formats)."""
    if shard.world == 1:
        return ShardedWeights(weights, {})
    check_tensor_parallel(config, shard.world)
    d = config.head_dim
    q0, q1 = shard.part(config.num_attention_heads)
    k0, k1 = shard.kv_heads(config.num_key_value_heads)
    i0, i1 = shard.part(config.intermediate_size)
    v0, v1 = shard.vocab_range(config.vocab_size)
    out = dict(weights)
    amax: dict[str, torch.Tensor] = {}

    def unblocked(*names: str) -> None:
        """Blocks (GGUF, AWQ, GPTQ) dequantized where the format does not keep them (one at
        a time)."""
        for name in names:
            weight = out[name]
            if isinstance(weight, BlockWeight) and not keep_blocks:
                out[name] = weight.dequantize()

    def split_columns(name: str, start: int, stop: int) -> None:
        weight = out[name]
        if isinstance(weight, BlockWeight):
            try:  # block_columns refuses a split off the 32-weight blocks
                out[name] = block_columns(weight, start, stop)
            except ModelError as exc:
                raise ModelError(f"tensor parallelism cannot split {name}: {exc}") from None
            return
        if row_amax:
            amax[name] = weight.abs().amax(dim=1).to(torch.float32)
        out[name] = weight[:, start:stop].contiguous()

    def split_experts(moe: MoeConfig, layer: int) -> None:
        """Each expert (and the shared one) split as the dense MLP is; the routers whole."""
        e0, e1 = shard.part(moe.intermediate_size)
        for expert in range(moe.num_experts):
            gate, up, down = moe.expert(layer, expert)
            unblocked(gate, up, down)
            out[gate], out[up] = rows(out[gate], e0, e1), rows(out[up], e0, e1)
            split_columns(down, e0, e1)
        if moe.shared_intermediate_size:
            s0, s1 = shard.part(moe.shared_intermediate_size)
            gate, up, down, _ = moe.shared(layer)
            unblocked(gate, up, down)
            out[gate], out[up] = rows(out[gate], s0, s1), rows(out[up], s0, s1)
            split_columns(down, s0, s1)

    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in out:
            out[name] = rows(out[name], v0, v1)
    for layer in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        for kind in ("weight", "bias"):
            if f"{attn}.q_proj.{kind}" not in out:
                continue
            out[f"{attn}.q_proj.{kind}"] = rows(out[f"{attn}.q_proj.{kind}"], q0 * d, q1 * d)
            for n in ("k", "v"):
                out[f"{attn}.{n}_proj.{kind}"] = rows(
                    out[f"{attn}.{n}_proj.{kind}"], k0 * d, k1 * d
                )
        unblocked(f"{attn}.o_proj.weight")  # (an AWQ or GPTQ checkpoint's, under int8 ...)
        split_columns(f"{attn}.o_proj.weight", q0 * d, q1 * d)
        if config.moe is not None and config.sparse_layer(layer):
            split_experts(config.moe, layer)
            continue
        for n in ("gate", "up"):
            out[f"{mlp}.{n}_proj.weight"] = rows(out[f"{mlp}.{n}_proj.weight"], i0, i1)
        unblocked(f"{mlp}.down_proj.weight")
        split_columns(f"{mlp}.down_proj.weight", i0, i1)
    return ShardedWeights(out, amax)
