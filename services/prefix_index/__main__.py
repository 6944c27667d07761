"""``python -m services.prefix_index``. Nothing to hand over on shutdown: the state lives in the
stream, and another replica (or this one, restarted) rebuilds it from there."""

from __future__ import annotations

from common.runtime import run_service
from services.prefix_index.service import PrefixIndexService, parse_args

if __name__ == "__main__":
    run_service("prefix_index", parse_args, PrefixIndexService)
