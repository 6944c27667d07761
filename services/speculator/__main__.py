from __future__ import annotations

import asyncio
import logging
import sys

from common.runtime import run
from services.speculator.service import SpeculatorService, build_proposer, parse_args

log = logging.getLogger("meshserve.speculator")


async def main(argv: list[str]) -> None:
    config = parse_args(argv)
    log.info("speculator config: %s", config)
    proposer = await asyncio.get_running_loop().run_in_executor(None, build_proposer, config)
    service = SpeculatorService(config, proposer)
    await service.start()
    service.svc.install_signal_handlers()
    await service.svc.shutdown_requested.wait()
    await service.svc.close()  # drain: calls already received are answered first


if __name__ == "__main__":
    run(lambda: main(sys.argv[1:]))
