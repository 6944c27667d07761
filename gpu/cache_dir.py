"""Where meshserve keeps what it makes once and reuses: converted models (``gpu.gguf``),
compiled CPU kernels (``gpu.cpu_kernels``), ``meshserve up``'s service logs. Plain ``os`` and
``pathlib``: a launcher asks for it without loading the runtime."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: Path | None = None) -> Path:
    """``cache_dir``, else ``$MESHSERVE_CACHE``, else ``~/.cache/meshserve``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("MESHSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshserve"
