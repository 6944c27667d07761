from __future__ import annotations

import logging
import sys

from common.runtime import run
from services.scheduler.service import SchedulerService, parse_args

log = logging.getLogger("meshserve.scheduler")


async def main(argv: list[str]) -> None:
    config = parse_args(argv)
    log.info("scheduler config: %s", config)
    service = SchedulerService(config)
    await service.start()
    service.svc.install_signal_handlers()
    await service.svc.shutdown_requested.wait()
    await service.svc.close()


if __name__ == "__main__":
    run(lambda: main(sys.argv[1:]))
