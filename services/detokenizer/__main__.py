"""``python -m services.detokenizer``."""

from __future__ import annotations

from common.runtime import run_service
from services.detokenizer.service import DetokenizerService, parse_args

if __name__ == "__main__":
    run_service("detokenizer", parse_args, DetokenizerService)
