"""``python -m services.gateway --nats-url ... --port 8000 --served-model-name smollm2``."""

from __future__ import annotations

from common.runtime import run
from services.gateway.app import serve
from services.gateway.config import serving_config


def main(argv: list[str] | None = None) -> None:
    config = serving_config(argv)  # refuses an open API on a public address
    run(lambda: serve(config))


if __name__ == "__main__":
    main()
