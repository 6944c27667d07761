"""Settings every service shares, from CLI flags with environment-variable defaults.

Each service declares its own frozen config dataclass holding a ``MeshConfig``; flags win over
environment variables (``MESHSERVE_<FLAG>``), which win over defaults. The config is logged once
at start-up and never mutated.
"""

from __future__ import annotations

import argparse
import os
import socket
import ssl
import uuid
from dataclasses import dataclass, field
from typing import Any

from common.nats_permissions import inbox_prefix
from common.subjects import DEFAULT_PREFIX, Subjects


def env(name: str, default: str) -> str:
    return os.environ.get(f"MESHSERVE_{name}", default)


@dataclass(frozen=True)
class NatsAuth:
    """How a service proves itself to NATS and checks the server (all optional)."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    creds_file: str | None = None  # a NATS .creds file (JWT + nkey seed)
    nkey_seed_file: str | None = None
    tls_ca: str | None = None  # verify the server with this CA (turns TLS on)
    tls_cert: str | None = None  # client certificate for mutual TLS
    tls_key: str | None = None

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise ValueError("--nats-user and --nats-password go together")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--nats-tls-cert and --nats-tls-key go together")

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``."""
        options: dict[str, Any] = {}
        if self.user is not None:
            options["user"], options["password"] = self.user, self.password
            # Replies to this user's requests come to _INBOX.<user>.*: with one NATS user per
            # service, its permissions then open only its own inbox (common/nats_permissions.py).
            options["inbox_prefix"] = inbox_prefix(self.user)
        if self.creds_file:
            options["user_credentials"] = self.creds_file
        if self.nkey_seed_file:
            options["nkeys_seed"] = self.nkey_seed_file
        if self.tls_ca or self.tls_cert:
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert and self.tls_key:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            options["tls"] = context
        return options

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--nats-user", default=env("NATS_USER", "") or None)
        parser.add_argument("--nats-password", default=env("NATS_PASSWORD", "") or None)
        parser.add_argument("--nats-creds", default=env("NATS_CREDS", "") or None)
        parser.add_argument("--nats-nkey-seed", default=env("NATS_NKEY_SEED", "") or None)
        parser.add_argument("--nats-tls-ca", default=env("NATS_TLS_CA", "") or None)
        parser.add_argument("--nats-tls-cert", default=env("NATS_TLS_CERT", "") or None)
        parser.add_argument("--nats-tls-key", default=env("NATS_TLS_KEY", "") or None)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> NatsAuth:
        return cls(
            a.nats_user,
            a.nats_password,
            a.nats_creds,
            a.nats_nkey_seed,
            a.nats_tls_ca,
            a.nats_tls_cert,
            a.nats_tls_key,
        )


@dataclass(frozen=True)
class MeshConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    subject_prefix: str = DEFAULT_PREFIX
    instance_id: str = ""
    log_level: str = "INFO"
    auth: NatsAuth = field(default_factory=NatsAuth)
    # Observability (common/telemetry.py, common/metrics.py): the OTLP/HTTP base URL for
    # traces ("" = the standard OTEL_* variables decide), and the port of /metrics + /health
    # for services without an HTTP API (None = not served; 0 = any free port).
    otlp_endpoint: str = ""
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"

    def __post_init__(self) -> None:
        if not self.nats_url:
            raise ValueError("nats_url must not be empty")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be in 0..65535")
        if not self.instance_id:
            # No dots: the id is one subject token (gateway.<id>.inbox), which per-service NATS
            # permissions match with a single-token wildcard (common/nats_permissions.py).
            host = socket.gethostname().replace(".", "-")
            object.__setattr__(self, "instance_id", f"{host}-{uuid.uuid4().hex[:6]}")

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.subject_prefix)

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--nats-url", default=env("NATS_URL", "nats://127.0.0.1:4222"))
        parser.add_argument("--subject-prefix", default=env("SUBJECT_PREFIX", DEFAULT_PREFIX))
        parser.add_argument("--instance-id", default=env("INSTANCE_ID", ""))
        parser.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"))
        NatsAuth.add_args(parser)
        parser.add_argument(
            "--otlp-endpoint",
            default=env("OTLP_ENDPOINT", ""),
            help="OTLP/HTTP base URL for traces, e.g. http://jaeger:4318 "
            "(default: the OTEL_EXPORTER_OTLP_* variables)",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=int(env("METRICS_PORT", "-1")),
            help="serve /metrics and /health on this port (-1: off; the gateway always serves "
            "them on its HTTP port)",
        )
        parser.add_argument("--metrics-host", default=env("METRICS_HOST", "0.0.0.0"))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MeshConfig:
        return cls(
            args.nats_url,
            args.subject_prefix,
            args.instance_id,
            args.log_level,
            auth=NatsAuth.from_args(args),
            otlp_endpoint=args.otlp_endpoint,
            metrics_port=None if args.metrics_port < 0 else args.metrics_port,
            metrics_host=args.metrics_host,
        )
