"""Reading a GGUF file: header, metadata and tensor descriptors (tensor data stays mmapped)."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpu.config import ModelError

GGUF_MAGIC = b"GGUF"


@dataclass
class Tensor:
    """One tensor of a GGUF file: ``shape`` in GGUF order (fastest dimension first)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # raw bytes, uint8, shaped (..., bytes per row)


@dataclass
class Gguf:
    """What conversion needs from a GGUF file: metadata values and the tensors."""

    path: Path
    meta: dict[str, Any]
    tensors: list[Tensor]

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


def _parse_gguf(path: Path) -> Gguf:
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
    tensors: list[Tensor] = []
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
        tensors.append(Tensor(name=name, tensor_type=qtype, shape=dims, data=data))
    return Gguf(path=path, meta=meta, tensors=tensors)


def read_gguf(path: Path) -> Gguf:
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
