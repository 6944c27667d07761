"""LoRA adapters over the base model, many at once (vLLM's ``--lora-modules``): each request
names one (or none), and one step's batch mixes them.

An adapter is a PEFT folder (``adapter_config.json`` and ``adapter_model.safetensors``) for
the base model's attention and MLP projections. Its low-rank pairs stay apart from the base
weights (nothing is merged: the base serves every other request in the same step); each
adapted linear's output gains ``(x @ A.T) @ B.T`` on the rows of the requests that use it,
with the scale (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) folded into B at load.

The model fuses q/k/v and gate/up into one matmul each; an adapter's pairs are fused the same
way: the A's stacked (``[sum r, in]``) and the B's block-diagonal (``[out, sum r]``, zero where
a projection is not adapted), so one extra pair of small matmuls per fused linear and adapter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpu.config import ModelConfig, ModelError
from gpu.transfers import move

# The model's fused linears and, in order, the projections each stacks.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_BLOCK = {p: "self_attn" for p in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
    p: "mlp" for p in ("gate_proj", "up_proj", "down_proj")
}
MAX_LORA_RANK = 256
MAX_LORAS = 64  # served at once by a replica (each is named in every heartbeat)


class UnknownAdapter(ModelError):
    """A request names an adapter this replica does not serve (a 404, as an unknown model)."""


class AdapterBusy(ModelError):
    """An adapter unloaded under this name still serves requests: loading another under it
    must wait (their cached pages carry the name's hashes)."""


@dataclass(frozen=True)
class LoraPair:
    """One fused linear's low-rank update: ``out += (x @ a.T) @ b.T``."""

    a: torch.Tensor  # [R, in]
    b: torch.Tensor  # [out, R], the scale folded in


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int  # the largest of its projections'
    layers: tuple[dict[str, LoraPair], ...]  # per layer: fused linear -> its pair (or absent)
    source: str = ""  # the folder it was read from

    def to(self, device: torch.device, dtype: torch.dtype) -> LoraAdapter:
        moved = tuple(
            {k: LoraPair(p.a.to(device, dtype), p.b.to(device, dtype)) for k, p in layer.items()}
            for layer in self.layers
        )
        return LoraAdapter(self.name, self.rank, moved, self.source)


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter folder's two files, read (no torch: ``read_adapter`` may run anywhere)."""

    folder: Path
    config: dict[str, Any]
    weights: bytes  # adapter_model.safetensors


def _adapter_config(folder: Path) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise ModelError(f"{folder} is not a PEFT LoRA adapter (no adapter_config.json)")
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelError(f"{path} is not a JSON object")
    refusals = {
        "peft_type": raw.get("peft_type", "LORA") not in ("LORA", None),
        "use_dora": bool(raw.get("use_dora")),
        "bias": raw.get("bias", "none") not in ("none", None),
        "modules_to_save": bool(raw.get("modules_to_save")),
        "fan_in_fan_out": bool(raw.get("fan_in_fan_out")),
        "alpha_pattern": bool(raw.get("alpha_pattern")),
        "lora_bias": bool(raw.get("lora_bias")),
    }
    refused = [key for key, bad in refusals.items() if bad]
    if refused:
        raise ModelError(f"{path}: unsupported LoRA settings: {', '.join(refused)}")
    return raw


def _projection_of(name: str, num_layers: int) -> tuple[int, str, str] | None:
    """``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` (or
    ``...lora_A.default.weight``, an adapter's name before ``weight``) -> (3, "q_proj", "A");
    None for a name of anything else (a bias, a magnitude vector, an embedding's pair)."""
    parts = name.split(".")
    try:
        at = parts.index("layers")
        layer, proj, kind = int(parts[at + 1]), parts[at + 3], parts[at + 4]
    except (ValueError, IndexError):
        return None
    if proj not in _BLOCK or kind not in ("lora_A", "lora_B") or parts[at + 2] != _BLOCK[proj]:
        return None
    if parts[-1] != "weight" or len(parts) not in (at + 6, at + 7):
        return None
    if not 0 <= layer < num_layers:
        raise ModelError(f"LoRA tensor {name!r} names layer {layer} of {num_layers}")
    return layer, proj, kind[-1]


def read_adapter(folder: Path | str) -> AdapterFiles:
    """A PEFT adapter folder's files; ``ModelError`` where they are missing or unreadable."""
    folder = Path(folder)
    try:
        raw = _adapter_config(folder)
        weights_path = folder / "adapter_model.safetensors"
        if not weights_path.is_file():
            raise ModelError(f"{folder} has no adapter_model.safetensors")
        return AdapterFiles(folder, raw, weights_path.read_bytes())
    except OSError as exc:  # (a name too long, a permission: the client's path, not us)
        raise ModelError(f"{folder}: {exc}") from exc


def load_adapter(name: str, folder: Path | str, config: ModelConfig) -> LoraAdapter:
    """Read a PEFT LoRA adapter for a model of ``config``; ``ModelError`` names what does not
    fit (a projection it does not know, a shape, a setting it does not compute)."""
    return build_adapter(name, read_adapter(folder), config)


def build_adapter(name: str, files: AdapterFiles, config: ModelConfig) -> LoraAdapter:
    """The adapter in ``files`` for a model of ``config`` (torch work: on the engine's thread
    in a running executor)."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_bytes

    raw, weights_path = files.config, files.folder / "adapter_model.safetensors"
    try:
        tensors = load_bytes(files.weights)
        alpha = float(raw.get("lora_alpha", 8))  # (peft's default)
    except (SafetensorError, ValueError, TypeError) as exc:
        raise ModelError(f"{files.folder}: cannot read the adapter: {exc}") from exc
    rslora = bool(raw.get("use_rslora"))
    out_of = {
        "q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size,
        "o_proj": config.hidden_size, "gate_proj": config.intermediate_size,
        "up_proj": config.intermediate_size, "down_proj": config.hidden_size,
    }  # fmt: skip
    in_of = {p: config.hidden_size for p in out_of} | {
        "o_proj": config.q_size,
        "down_proj": config.intermediate_size,
    }
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        found = _projection_of(tensor_name, config.num_hidden_layers)
        if found is None:
            raise ModelError(
                f"{weights_path}: LoRA tensor {tensor_name!r} is not for an attention or MLP "
                "projection (supported: q/k/v/o_proj, gate/up/down_proj)"
            )
        index, proj, kind = found
        if _BLOCK[proj] == "mlp" and config.sparse_layer(index):
            raise ModelError(
                f"{weights_path}: LoRA tensor {tensor_name!r}: layer {index}'s MLP is a "
                "mixture of experts, which LoRA adapters are not supported on (attention "
                "projections are)"
            )
        pairs.setdefault((index, proj), {})[kind] = tensor.float()
    layers: list[dict[str, LoraPair]] = [{} for _ in range(config.num_hidden_layers)]
    rank = 0
    for i, layer in enumerate(layers):
        for fused, projs in FUSED.items():
            parts: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = []
            for proj in projs:
                pair = pairs.get((i, proj))
                if pair is None:
                    parts.append((proj, None, None))
                    continue
                a, b = pair.get("A"), pair.get("B")
                r = 0 if a is None or a.dim() != 2 else a.shape[0]
                if (
                    a is None
                    or b is None
                    or a.shape != (r, in_of[proj])
                    or b.shape
                    != (
                        out_of[proj],
                        r,
                    )
                ):
                    raise ModelError(
                        f"{weights_path}: layer {i} {proj}: lora_A/lora_B must be "
                        f"[r, {in_of[proj]}] and [{out_of[proj]}, r]"
                    )
                if not 0 < r <= MAX_LORA_RANK:
                    raise ModelError(f"{weights_path}: rank {r} outside 1..{MAX_LORA_RANK}")
                rank = max(rank, r)
                parts.append((proj, a, b * (alpha / (math.sqrt(r) if rslora else r))))
            if all(a is None for _, a, _ in parts):
                continue
            given = [a for _, a, _ in parts if a is not None]
            stacked_a = torch.cat(given)
            block_b = torch.zeros(sum(out_of[p] for p in projs), int(stacked_a.shape[0]))
            row = col = 0
            for proj, a, b in parts:
                if a is not None and b is not None:
                    block_b[row : row + out_of[proj], col : col + a.shape[0]] = b
                    col += a.shape[0]
                row += out_of[proj]
            layer[fused] = LoraPair(stacked_a.contiguous(), block_b)
    if rank == 0:
        raise ModelError(f"{weights_path} holds no LoRA pairs")
    return LoraAdapter(name, rank, tuple(layers), str(files.folder))


class LoraSet:
    """The adapters a replica serves, in slots 1.. (0: the base model alone)."""

    def __init__(self, adapters: Sequence[LoraAdapter]) -> None:
        self.adapters = list(adapters)
        self.slots = {a.name: i + 1 for i, a in enumerate(self.adapters)}
        self.retired: set[int] = set()  # slots of removed adapters whose tensors are held

    def add(self, adapter: LoraAdapter) -> None:
        """Serve one more (at run time: a slot of its own, after every other's)."""
        if adapter.name in self.slots:
            raise ModelError(f"a LoRA adapter named {adapter.name!r} is loaded already")
        if len(self.slots) >= MAX_LORAS:
            raise ModelError(f"{MAX_LORAS} LoRA adapters are loaded already: unload one first")
        if any(self.adapters[s - 1].name == adapter.name for s in self.retired):
            raise AdapterBusy(
                f"The LoRA adapter `{adapter.name}` unloaded last still serves requests; retry "
                "once they finish."
            )
        self.adapters.append(adapter)
        self.slots[adapter.name] = len(self.adapters)

    def remove(self, name: str) -> int:
        """Serve ``name`` to no new request; its slot (returned) stays for the sequences
        that use it (``release`` frees it once none does)."""
        slot = self.slots.pop(name, None)
        if slot is None:
            raise UnknownAdapter(f"The model `{name}` (a LoRA adapter) is not loaded here.")
        self.retired.add(slot)
        return slot

    def release(self, in_use: set[int]) -> bool:
        """Free the tensors of removed adapters' slots no sequence uses now (the engine's
        thread calls this between steps); whether any was freed (the caller then drops the
        cached pages: an adapter loaded under that name later must not find them)."""
        freed = [s for s in self.retired if s not in in_use]
        for slot in freed:
            self.retired.discard(slot)
            self.adapters[slot - 1] = LoraAdapter(self.adapters[slot - 1].name, 0, ())
        return bool(freed)

    def source_of(self, name: str) -> str | None:
        """The folder adapter ``name`` was loaded from (None: not loaded)."""
        slot = self.slots.get(name)
        return None if slot is None else self.adapters[slot - 1].source

    def slot(self, name: str) -> int:
        """The slot of adapter ``name`` ("" : the base model's 0); ``ModelError`` if unknown."""
        if not name:
            return 0
        slot = self.slots.get(name)
        if slot is None:
            raise UnknownAdapter(f"The model `{name}` (a LoRA adapter) is not loaded here.")
        return slot

    def step(
        self, adapters: Sequence[int], lengths: Sequence[int], device: torch.device
    ) -> LoraStep | None:
        """A step's row groups: ``adapters[b]`` is sequence b's slot, ``lengths[b]`` its new
        tokens (consecutive rows, in batch order); None when no row uses an adapter."""
        rows: dict[int, list[int]] = {}
        start = 0
        for slot, n in zip(adapters, lengths, strict=True):
            if slot:
                rows.setdefault(slot, []).extend(range(start, start + n))
            start += n
        if not rows:
            return None
        groups: list[tuple[LoraAdapter, slice | torch.Tensor]] = []
        for slot, r in sorted(rows.items()):
            if r[-1] - r[0] + 1 == len(r):  # one run of rows: a view, no gather or scatter
                groups.append((self.adapters[slot - 1], slice(r[0], r[-1] + 1)))
            else:  # (through pinned memory: a pageable copy would wait for the step in flight)
                rows_on_device = move(torch.tensor(r, dtype=torch.int64), device)
                groups.append((self.adapters[slot - 1], rows_on_device))
        return LoraStep(groups)


@dataclass(frozen=True)
class LoraStep:
    """One step's adapters and the flat token rows each applies to: a run of rows (a slice),
    or scattered ones (an index tensor on the device)."""

    groups: list[tuple[LoraAdapter, slice | torch.Tensor]]

    def add_(self, layer: int, linear: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[rows] += (x[rows] @ A.T) @ B.T`` for each adapter's rows (``x`` the linear's
        input ``[T, in]``, ``out`` its output ``[T, out]``, in place)."""
        for adapter, rows in self.groups:
            pair = adapter.layers[layer].get(linear)
            if pair is None:
                continue
            if isinstance(rows, slice):
                out[rows].addmm_(x[rows] @ pair.a.T, pair.b.T)
            else:
                update = (x.index_select(0, rows) @ pair.a.T) @ pair.b.T
                out.index_add_(0, rows, update)
