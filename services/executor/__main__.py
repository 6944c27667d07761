"""``python -m services.executor``; on SIGTERM/SIGINT it stops taking work, finishes the
sequences in flight (at most 30 s), then leaves the mesh."""

from __future__ import annotations

import asyncio
import contextlib

from common.runtime import run_service
from services.executor.config import ExecutorConfig, parse_args
from services.executor.service import ExecutorService, build_engine, engine_thread


async def build(config: ExecutorConfig) -> ExecutorService:
    worker = engine_thread(config.engine_nice)  # loads the model, then runs every step
    engine = await asyncio.get_running_loop().run_in_executor(worker, build_engine, config)
    return ExecutorService(config, engine, worker)


async def drain_and_stop(service: ExecutorService) -> None:
    await service.drain()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(_until_idle(service), timeout=30)
    await service.stop()
    if service.broken:  # a step failed or its tensor-parallel group lost a rank
        raise SystemExit(3)  # a failure, for whoever supervises us (meshserve up restarts it)


async def _until_idle(service: ExecutorService) -> None:
    decode = service.decode_side  # reservations waiting for a prefill executor's KV
    while (
        service.engine.has_unfinished()
        or service.pending_adds
        or service.compiling
        or (decode and decode.waiting)
    ):
        if service.broken:  # it broke while draining: nothing more will finish
            return
        await asyncio.sleep(0.05)


if __name__ == "__main__":
    run_service("executor", parse_args, build, drain_and_stop)
