"""``python -m gpu.gguf [SPEC]``: resolve a ``--model`` value (see ``resolve_model_path``) to a
Hugging Face folder, converting a GGUF file once into the cache, and print one JSON line on
stdout: ``{"folder": PATH}``, or ``{"error": MESSAGE}`` with exit status 2. Progress and logs
go to stderr.

``meshserve up`` resolves its models this way, in a process that ends right after: converting
dequantizes every weight (the bundled SmolLM2 peaks near 900 MB), and the launcher lives as
long as the mesh does.
"""

from __future__ import annotations

import json
import logging
import sys

from gpu.gguf.cache import resolve_model_path


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        folder = resolve_model_path(argv[0] if argv else None)
    except (ValueError, OSError) as exc:  # ModelError is a ValueError
        sys.stdout.write(json.dumps({"error": str(exc)}) + "\n")
        return 2
    sys.stdout.write(json.dumps({"folder": str(folder)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
