from __future__ import annotations

import logging
import sys

from common.runtime import run
from services.detokenizer.service import DetokenizerService, parse_args

log = logging.getLogger("meshserve.detokenizer")


async def main(argv: list[str]) -> None:
    config = parse_args(argv)
    log.info("detokenizer config: %s", config)
    service = DetokenizerService(config)
    await service.start()
    service.svc.install_signal_handlers()
    await service.svc.shutdown_requested.wait()
    await service.svc.close()


if __name__ == "__main__":
    run(lambda: main(sys.argv[1:]))
