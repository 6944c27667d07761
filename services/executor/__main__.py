from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

from common.runtime import run
from services.executor.config import parse_args
from services.executor.service import ExecutorService, build_engine

log = logging.getLogger("meshserve.executor")


async def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    log.info("executor config: %s", config)
    engine = await asyncio.get_running_loop().run_in_executor(None, build_engine, config)
    service = ExecutorService(config, engine)
    await service.start()
    service.svc.install_signal_handlers()
    await service.svc.shutdown_requested.wait()
    # Drain: stop taking work, finish the sequences in flight (bounded), then close.
    await service.drain()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(_until_idle(service), timeout=30)
    await service.stop()


async def _until_idle(service: ExecutorService) -> None:
    while service.engine.has_unfinished() or service.pending_adds:
        await asyncio.sleep(0.05)


if __name__ == "__main__":
    run(lambda: main(sys.argv[1:]))
