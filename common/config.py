"""Settings every service shares, from CLI flags with environment-variable defaults.

Each service declares its own frozen config dataclass holding a ``MeshConfig``; flags win over
environment variables (``MESHSERVE_<FLAG>``), which win over defaults. The config is logged once
at start-up and never mutated.
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from dataclasses import dataclass

from common.subjects import DEFAULT_PREFIX, Subjects


def env(name: str, default: str) -> str:
    return os.environ.get(f"MESHSERVE_{name}", default)


@dataclass(frozen=True)
class MeshConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    subject_prefix: str = DEFAULT_PREFIX
    instance_id: str = ""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.nats_url:
            raise ValueError("nats_url must not be empty")
        if not self.instance_id:
            object.__setattr__(
                self, "instance_id", f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
            )

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.subject_prefix)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--nats-url", default=env("NATS_URL", "nats://127.0.0.1:4222"))
        parser.add_argument("--subject-prefix", default=env("SUBJECT_PREFIX", DEFAULT_PREFIX))
        parser.add_argument("--instance-id", default=env("INSTANCE_ID", ""))
        parser.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MeshConfig:
        return cls(args.nats_url, args.subject_prefix, args.instance_id, args.log_level)
