"""Pre-quantized 4-bit checkpoints (AWQ, GPTQ) read into the runtime's Q4_1 blocks.

Both store a linear's weight as 4-bit codes ``q`` with, per group of ``group_size`` input
features and per output feature, a scale ``s`` (fp16) and a zero point ``z``:
``w = s * (q - z)``. That is a GGUF Q4_1 block (``w = d * q + m``, 32 input features) with
``d = s`` and ``m = -s * z`` whenever a group spans whole blocks of 32 (group sizes 32, 64,
128, ...; -1, a whole row): the codes are kept as they are, ``d`` exactly, ``m`` rounded to
fp16 (a relative error of 2^-11 of ``s * z``, far below the 4-bit step). Such weights run on
the blocks' kernels (``gpu.quant.BlockWeight``: the CPU's C kernels, CUDA's Triton block
matmul) under ``--quantization auto`` / ``gguf``, and are dequantized for any other format.
A GPTQ checkpoint whose groups do not follow the input order (``desc_act``) is dequantized.

Layouts (as AutoAWQ and AutoGPTQ / GPTQModel write them; ``W`` is ``[out, in]``):

- AWQ (``version: gemm``): ``qweight`` int32 ``[in, out / 8]``, eight codes of consecutive
  output features per int32 in the order 0, 2, 4, 6, 1, 3, 5, 7 (low nibble first);
  ``qzeros`` int32 ``[groups, out / 8]`` the same way; ``scales`` fp16 ``[groups, out]``.
- GPTQ: ``qweight`` int32 ``[in / 8, out]``, eight codes of consecutive input features per
  int32, low nibble first; ``qzeros`` int32 ``[groups, out / 8]``, consecutive output
  features, low nibble first, stored less one in the original format (``checkpoint_format``
  ``gptq``; ``gptq_v2`` stores them as they are); ``scales`` fp16 ``[groups, out]``;
  ``g_idx`` int32 ``[in]``, each input feature's group.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpu.config import ModelError
from gpu.quant import QK, BlockWeight

log = logging.getLogger("meshserve.prequantized")

PARTS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # packed position i holds output feature AWQ_ORDER[i]
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class Prequantized:
    method: str  # "awq" | "gptq"
    group_size: int  # -1: one group a row
    zero_offset: int = 0  # added to the stored zero points (GPTQ's original format: 1)
    desc_act: bool = False  # GPTQ: groups in the order of g_idx (else g_idx is not read)

    @classmethod
    def from_folder(cls, folder: Path) -> Prequantized | None:
        """From ``config.json``'s ``quantization_config``, or where older checkpoints keep it
        (``quantize_config.json``, AutoGPTQ's; ``quant_config.json``, AutoAWQ's), as vLLM
        reads them."""
        raw = json.loads((folder / "config.json").read_text())
        if raw.get("quantization_config"):
            return cls.from_config(raw)
        for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
            path = folder / name
            if path.is_file():
                q = json.loads(path.read_text())
                return cls.from_config({"quantization_config": {"quant_method": method, **q}})
        return None

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> Prequantized | None:
        """The checkpoint's ``quantization_config``, or None; a ``ModelError`` for one this
        runtime does not read."""
        q = raw.get("quantization_config")
        if not q:
            return None
        if not isinstance(q, dict):
            raise ModelError("config.json's quantization_config is not an object")
        method = str(q.get("quant_method", "?")).lower()
        bits = q.get("bits", q.get("w_bit"))
        group = q.get("group_size", q.get("q_group_size", -1))
        if method not in ("awq", "gptq"):
            raise ModelError(
                f"pre-quantized checkpoints of quant_method {method!r} are not supported (awq "
                "and gptq, 4-bit, are): load the unquantized weights and quantize them at load "
                "time (--quantization)"
            )
        if bits != 4:
            raise ModelError(f"{method} checkpoints of {bits} bits are not supported (4 are)")
        if not isinstance(group, int) or not (group == -1 or group > 0):
            raise ModelError(f"{method} group_size {group!r} is not a positive size or -1")
        if method == "awq":
            version = str(q.get("version", "gemm")).lower()
            if version != "gemm":
                raise ModelError(
                    f"AWQ checkpoints of version {version!r} are not supported (gemm is)"
                )
            if not q.get("zero_point", True):
                raise ModelError("AWQ checkpoints without zero points are not supported")
            return cls("awq", group)
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        if q.get("dynamic"):
            raise ModelError(
                "GPTQ checkpoints with per-module settings (dynamic) are not supported"
            )
        offset = 1 if fmt == "gptq" else 0
        return cls("gptq", group, zero_offset=offset, desc_act=bool(q.get("desc_act")))

    def weight(self, name: str, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> Any:
        """The weight ``[out, in]`` of the linear whose tensors are ``parts``: blocks where
        its groups span whole blocks of 32 (Q4_0 where every zero point is 8, GPTQ's
        symmetric default: exact; else Q4_1), dequantized exactly (``s * (q - z)``, fp32)
        otherwise. Blocks are kept as blocks even where the model will not run them: it
        dequantizes one tensor at a time as it builds each layer (``gpu.model.DeviceWeights``),
        where a whole checkpoint in fp32 would take 8x its size at once."""
        out_features, in_features = shape
        missing = [p for p in PARTS[:3] if p not in parts]
        if missing:
            raise ModelError(f"{name}: the checkpoint lacks its {', '.join(missing)}")
        codes, zeros, scales = self.unpack(parts, out_features, in_features)
        groups = scales.shape[0]
        group_of = self.group_of(parts.get("g_idx") if self.desc_act else None, in_features,
                                 groups, name)  # fmt: skip
        if codes.shape != (in_features, out_features) or zeros.shape != (groups, out_features):
            raise ModelError(f"{name}: its quantized tensors do not make a [{out_features}, "
                             f"{in_features}] weight")  # fmt: skip
        aligned = in_features % QK == 0 and bool(
            (group_of.view(-1, QK) == group_of.view(-1, QK)[:, :1]).all()
        )
        if not aligned:
            log.info("%s: groups not in blocks of %d input features: dequantized", name, QK)
            z, s = zeros[group_of].float(), scales[group_of].float()
            return ((codes.float() - z) * s).t().contiguous()
        first = group_of.view(-1, QK)[:, 0]  # each block's group
        d = scales[first].t().contiguous()  # [out, blocks], fp16 as stored
        if bool((zeros == 8).all()):
            return BlockWeight("Q4_0", q4_0_rows(codes.t(), d), in_features)
        m = (-(scales[first].float() * zeros[first].float())).to(torch.float16).t().contiguous()
        return BlockWeight("Q4_1", q4_1_rows(codes.t(), d, m), in_features)

    def unpack(
        self, parts: dict[str, torch.Tensor], out_features: int, in_features: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes ``[in, out]``, zero points ``[groups, out]`` (uint8) and scales (fp16)."""
        qweight, qzeros = parts["qweight"].to(torch.int32), parts["qzeros"].to(torch.int32)
        scales = parts["scales"].to(torch.float16)
        zeros = nibbles_along_columns(qzeros)
        if self.method == "awq":
            codes = nibbles_along_columns(qweight)
            order = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])
            natural = (torch.arange(codes.shape[1]).view(-1, 8)[:, order]).reshape(-1)
            codes, zeros = codes[:, natural], zeros[:, natural]
        else:
            codes = ((qweight[:, None, :] >> SHIFTS[None, :, None]) & 15).reshape(
                -1, qweight.shape[1]
            )
            zeros = natural_gptq_zeros(zeros, self.zero_offset)
        return codes.to(torch.uint8), zeros.to(torch.uint8), scales

    def group_of(
        self, g_idx: torch.Tensor | None, in_features: int, groups: int, name: str
    ) -> torch.Tensor:
        """Each input feature's group: by ``g_idx`` (GPTQ's desc_act), else consecutive runs
        of group_size, which must be what the tensors hold (a config that disagrees with
        them would read every weight with another group's scale)."""
        size = in_features if self.group_size == -1 else self.group_size
        if g_idx is None:
            if -(-in_features // size) != groups:
                raise ModelError(
                    f"{name}: {groups} groups of scales for {in_features} input features, but "
                    f"the config's group_size is {self.group_size}"
                )
            return torch.arange(in_features) // size
        g = g_idx.to(torch.int64)
        if g.shape != (in_features,) or int(g.min()) < 0 or int(g.max()) >= groups:
            raise ModelError(f"{name}: its g_idx does not give each input feature a group")
        return g


def nibbles_along_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[r, c]`` -> its eight nibbles per int32, low first: ``[r, 8c]``."""
    return ((packed[:, :, None] >> SHIFTS[None, None, :]) & 15).reshape(packed.shape[0], -1)


def natural_gptq_zeros(zeros: torch.Tensor, offset: int) -> torch.Tensor:
    """GPTQ's stored zero points as the formula uses them: the original format stores
    ``z - 1``, read back as vLLM's and AutoGPTQ's kernels read it (a stored 15 is 16)."""
    return zeros + offset


def q4_0_rows(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Codes ``uint8 [n, k]`` with fp16 ``d`` ``[n, k / 32]`` -> Q4_0 rows ``uint8 [n, k /
    32 * 18]`` (``w = d * (q - 8)``: each block's d, then its codes as Q4_1's)."""
    n, k = codes.shape
    q = codes.reshape(n, k // QK, QK)
    packed = q[..., :16] | (q[..., 16:] << 4)
    head = d.contiguous().view(torch.uint8).reshape(n, k // QK, 2)
    return torch.cat([head, packed], dim=-1).reshape(n, k // QK * 18).contiguous()


def q4_1_rows(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Codes ``uint8 [n, k]`` (k a multiple of 32) with fp16 ``d``, ``m`` ``[n, k / 32]`` ->
    Q4_1 rows ``uint8 [n, k / 32 * 20]`` (``gpu.quant.quantize_q4_1``'s layout: each block's
    d and m, then its codes 0..15 in the low nibbles and 16..31 in the high)."""
    n, k = codes.shape
    q = codes.reshape(n, k // QK, QK)
    packed = q[..., :16] | (q[..., 16:] << 4)
    head = torch.stack([d, m], dim=-1).view(torch.uint8).reshape(n, k // QK, 4)
    return torch.cat([head, packed], dim=-1).reshape(n, k // QK * 20).contiguous()
