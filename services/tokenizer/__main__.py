from __future__ import annotations

import logging
import sys

from common.runtime import run
from services.tokenizer.service import TokenizerService, parse_args

log = logging.getLogger("meshserve.tokenizer")


async def main(argv: list[str]) -> None:
    config = parse_args(argv)
    log.info("tokenizer config: %s", config)
    service = TokenizerService(config)
    await service.start()
    service.svc.install_signal_handlers()
    await service.svc.shutdown_requested.wait()
    await service.svc.close()  # drain: requests already received are forwarded first


if __name__ == "__main__":
    run(lambda: main(sys.argv[1:]))
