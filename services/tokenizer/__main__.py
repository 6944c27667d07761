"""``python -m services.tokenizer``; on SIGTERM/SIGINT it drains: requests already received are
forwarded first."""

from __future__ import annotations

from common.runtime import run_service
from services.tokenizer.service import TokenizerService, parse_args

if __name__ == "__main__":
    run_service("tokenizer", parse_args, TokenizerService)
