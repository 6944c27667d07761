"""``python -m services.speculator``; on SIGTERM/SIGINT it drains: calls already received are
answered first."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from common.runtime import run_service
from services.speculator.service import (
    SpeculatorConfig,
    SpeculatorService,
    build_proposer,
    parse_args,
)


async def build(config: SpeculatorConfig) -> SpeculatorService:
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
    proposer = await asyncio.get_running_loop().run_in_executor(worker, build_proposer, config)
    return SpeculatorService(config, proposer, worker)


if __name__ == "__main__":
    run_service("speculator", parse_args, build)
