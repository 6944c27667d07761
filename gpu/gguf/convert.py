"""GGUF file -> Hugging Face folder, written atomically (temp dir + rename)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from gpu.config import ModelError
from gpu.gguf.hf_config import arch_of, build_config, eos_ids
from gpu.gguf.reader import read_gguf
from gpu.gguf.tokenizer import build_tokenizer
from gpu.gguf.weights import (
    dequantize,
    expert_names,
    hf_tensor_name,
    required_layer_tensors,
    unpermute_rope_rows,
)
from gpu.quant import BLOCK_BYTES

logger = logging.getLogger(__name__)

# Bump when the converter's output changes, so stale cache folders are rebuilt.
CONVERTER_VERSION = 2
MARKER_NAME = "meshserve_gguf.json"


def _progress_enabled(progress: bool) -> bool:
    return progress and sys.stderr.isatty()


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Convert ``gguf_path`` into a Hugging Face folder at ``out_dir`` and return ``out_dir``.

    Writes ``config.json``, ``model.safetensors`` (float32), ``tokenizer.json``,
    ``tokenizer_config.json``, ``generation_config.json`` and a marker file naming the source.
    The folder appears atomically: it is built in a temp dir next to ``out_dir`` and renamed;
    an existing ``out_dir`` is replaced.
    """
    from safetensors.numpy import save_file
    from tqdm import tqdm

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    g = read_gguf(gguf_path)
    arch = arch_of(g)
    tok, tok_config = build_tokenizer(g)

    names = {t.name for t in g.tensors}
    for required in ("token_embd.weight", "output_norm.weight"):
        if required not in names:
            raise ModelError(f"{gguf_path}: GGUF has no {required!r} tensor")
    tied = "output.weight" not in names

    weights: dict[str, np.ndarray] = {}
    bar = tqdm(
        g.tensors,
        desc=f"converting {gguf_path.name}",
        unit="tensor",
        disable=not _progress_enabled(progress),
    )
    in_source: list[str] = []  # experts left in the file's blocks (no fp32 copy written)
    for tensor in bar:
        hf_name = hf_tensor_name(tensor.name, arch.n_layers, arch.model_type)
        if hf_name is None:
            continue
        parts = expert_names(hf_name, arch.experts)
        if len(parts) > 1 and tensor.tensor_type.name in BLOCK_BYTES:
            # The bulk of a mixture of experts (a Qwen3-30B-A3B's 29 of 30 B weights): an fp32
            # copy would be 4-8x the file. The loader reads them from the file, in blocks or
            # dequantized one at a time (gpu.gguf.blocks).
            in_source += parts
            continue
        value = dequantize(tensor)
        if arch.permuted_qk:
            if ".attn_q." in tensor.name:
                value = unpermute_rope_rows(value, arch.n_head)
            elif ".attn_k." in tensor.name:
                value = unpermute_rope_rows(value, arch.n_head_kv)
        if hf_name.endswith("shared_expert_gate.weight"):
            value = value.reshape(1, -1)  # ([H] in the file, a [1, H] linear in transformers)
        if len(parts) > 1:  # the experts' stacked [E, N, K]: one tensor each
            if value.shape[0] != len(parts):
                raise ModelError(f"{tensor.name} holds {value.shape[0]} experts, not {len(parts)}")
            weights.update(
                {name: np.ascontiguousarray(v) for name, v in zip(parts, value, strict=True)}
            )
            continue
        weights[hf_name] = value
    missing = [
        f"model.layers.{i}.{suffix}"
        for i in range(arch.n_layers)
        for suffix in required_layer_tensors(arch.model_type)
        if f"model.layers.{i}.{suffix}" not in weights
    ]
    if missing:
        raise ModelError(f"{gguf_path}: GGUF lacks tensors {missing[:4]} ({len(missing)} in all)")

    vocab_size = int(weights["model.embed_tokens.weight"].shape[0])
    n_tokens = tok.get_vocab_size(with_added_tokens=True)
    if n_tokens > vocab_size:
        raise ModelError(
            f"{gguf_path}: the tokenizer has {n_tokens} tokens but the embedding only {vocab_size}"
        )
    # a mixture of experts' dense layers: those with a dense MLP's tensors
    dense = tuple(i for i in range(arch.n_layers) if f"blk.{i}.ffn_gate.weight" in names)
    config = build_config(g, arch, vocab_size, tied, dense if arch.experts else ())
    eos = eos_ids(g)
    generation: dict[str, Any] = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos if len(eos) > 1 else config["eos_token_id"],
    }
    if config["pad_token_id"] is not None:
        generation["pad_token_id"] = config["pad_token_id"]

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del weights
        tok.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tok_config)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation)
        stat = gguf_path.stat()
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        marker = {
            "converter_version": CONVERTER_VERSION,
            "source": str(gguf_path.resolve()),
            "source_size": stat.st_size,
            "source_mtime_ns": stat.st_mtime_ns,
            "files": files,
            "in_source": in_source,
        }
        _write_json(tmp / MARKER_NAME, marker)
        _finish_files(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s into %s", gguf_path, out_dir)
    return out_dir


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _finish_files(folder: Path) -> None:
    """Flush every file to disk and give the usual permissions (mkdtemp makes the dir 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in folder.iterdir():
        with p.open("rb") as fh:
            os.fsync(fh.fileno())
        p.chmod(0o666 & ~umask)
    folder.chmod(0o777 & ~umask)


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``, moving an existing ``out_dir`` aside first."""
    old: Path | None = None
    if out_dir.exists() or out_dir.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.rename(out_dir, old / "folder")
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
