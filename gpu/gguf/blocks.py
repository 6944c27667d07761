"""A converted model's GGUF blocks, for ``--quantization gguf``: the weights as the file holds
them (Q4_0, Q4_1, Q8_0), renamed and with llama.cpp's q/k row order undone, without the fp32
copy the converted folder holds.

The folder a GGUF file was converted into names its source (``meshserve_gguf.json``); while
that file is still there (same size and mtime) its blocks are read from it. A mixture of
experts' experts in a block type are only there (the folder lists them, ``in_source``): every
load reads them from the file, and formats other than ``gguf`` dequantize them. Rows are whole
blocks, so llama.cpp's q/k row permutation is undone on the raw bytes, exactly as on the
dequantized values. Tensors of other types are left to the folder's dequantized copy.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from gpu.config import ModelError
from gpu.gguf.convert import MARKER_NAME
from gpu.gguf.hf_config import arch_of
from gpu.gguf.reader import read_gguf
from gpu.gguf.weights import expert_names, hf_tensor_name, unpermute_rope_rows
from gpu.quant import BLOCK_BYTES, BlockWeight

logger = logging.getLogger(__name__)


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file ``folder`` was converted from, while it is unchanged; else None."""
    try:
        marker = json.loads((folder / MARKER_NAME).read_text(encoding="utf-8"))
        source = Path(marker["source"])
        stat = source.stat()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if stat.st_size != marker.get("source_size") or stat.st_mtime_ns != marker.get(
        "source_mtime_ns"
    ):
        return None
    return source


def in_source(folder: Path) -> list[str]:
    """The tensors ``folder`` leaves in its GGUF file (a mixture of experts' experts of a
    block type: ``gpu.gguf.convert``), by Hugging Face name."""
    try:
        marker = json.loads((folder / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    names = marker.get("in_source") if isinstance(marker, dict) else None
    return [str(n) for n in names] if isinstance(names, list) else []


def require_whole_folder(folder: Path | str, user: str) -> None:
    """Raise ``ModelError`` where ``folder`` leaves tensors in its GGUF file (``in_source``):
    ``user`` (a tool that loads the folder with transformers) would get random weights."""
    if in_source(Path(folder)):
        raise ModelError(
            f"{folder} keeps its experts in the GGUF file it was converted from, which "
            f"transformers does not read: {user} needs the model's Hugging Face checkpoint"
        )


def read_block_weights(source: Path, wanted: set[str]) -> dict[str, BlockWeight]:
    """The 2-D tensors of ``source`` among ``wanted`` (Hugging Face names) whose type has a
    block kernel, as ``BlockWeight``s (one copy each, out of the file's mapping)."""
    g = read_gguf(source)
    arch = arch_of(g)
    out: dict[str, BlockWeight] = {}
    skipped: set[str] = set()
    for tensor in g.tensors:
        name = hf_tensor_name(tensor.name, arch.n_layers, arch.model_type)
        if name is None or len(tensor.shape) not in (2, 3):
            continue
        parts = expert_names(name, arch.experts)
        if not set(parts) <= wanted or (len(tensor.shape) == 3) != (len(parts) > 1):
            continue
        qtype = tensor.tensor_type.name
        if qtype not in BLOCK_BYTES:
            skipped.add(qtype)
            continue
        rows = tensor.data
        if arch.permuted_qk and ".attn_q." in tensor.name:
            rows = unpermute_rope_rows(rows, arch.n_head)
        elif arch.permuted_qk and ".attn_k." in tensor.name:
            rows = unpermute_rope_rows(rows, arch.n_head_kv)
        if len(parts) > 1:  # the experts' stacked rows: [E, N, bytes], one weight each
            for part, expert_rows in zip(parts, rows, strict=True):
                data = torch.from_numpy(np.array(expert_rows, dtype=np.uint8, copy=True))
                out[part] = BlockWeight(qtype, data, int(tensor.shape[0]))
            continue
        data = torch.from_numpy(np.array(rows, dtype=np.uint8, copy=True))
        out[name] = BlockWeight(qtype, data, int(tensor.shape[0]))
    if skipped:
        logger.info(
            "%s: tensors of type %s have no block kernel; they run dequantized (fp32)",
            source.name,
            ", ".join(sorted(skipped)),
        )
    return out
