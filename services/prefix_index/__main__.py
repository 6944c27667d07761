from __future__ import annotations

import logging
import sys

from common.runtime import run
from services.prefix_index.service import PrefixIndexService, parse_args

log = logging.getLogger("meshserve.prefix_index")


async def main(argv: list[str]) -> None:
    config = parse_args(argv)
    log.info("prefix index config: %s", config)
    service = PrefixIndexService(config)
    await service.start()
    service.svc.install_signal_handlers()
    await service.svc.shutdown_requested.wait()
    # Nothing to hand over: the state lives in the stream, and another replica (or this one,
    # restarted) rebuilds it from there.
    await service.svc.close()


if __name__ == "__main__":
    run(lambda: main(sys.argv[1:]))
