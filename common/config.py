"""Settings every service shares, and the shared definitions of settings several services take.

Each service declares its own frozen config dataclass holding a ``MeshConfig``; its flags and
``MESHSERVE_*`` variables are derived from the fields (``common.settings``): flags win over
environment variables (``MESHSERVE_<FLAG>``), which win over defaults. The config is logged once
at start-up and never mutated.
"""

from __future__ import annotations

import socket
import ssl
import uuid
from dataclasses import dataclass, field
from typing import Any

from common.nats_permissions import inbox_prefix
from common.settings import setting
from common.subjects import DEFAULT_PREFIX, Subjects, region_subjects
from common.wire.codec import MAX_ID_LEN, id_ok

# Tokenizer (page hashes), executors (KV pages) and speculator (draft KV pages) must page alike:
# the scheduler refuses executors paging differently from the tokenizer.
PAGE_SIZE = 16


def model_setting() -> Any:
    """``--model``: tokenizer, detokenizer and executors must load the same model."""
    return setting(
        help="a Hugging Face folder, a .gguf file, or 'default' (the bundled SmolLM2-135M); "
        "tokenizer, detokenizer and executors must name the same model"
    )


def lora_modules_setting() -> Any:
    """``--lora-modules`` of the gateway (the names it accepts as models) and the executors
    (the adapters they load): vLLM's flag."""
    return setting(
        (),
        "LoRA adapters served beside the model, NAME=PATH each (a PEFT folder, its path "
        "without a comma; vLLM's --lora-modules): a request naming NAME as its model runs "
        "with that adapter; the gateway and every executor must list the same",
    )


def parse_lora_modules(specs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``--lora-modules`` as {name: path}; a ``ValueError`` names a malformed entry."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


def page_size_setting() -> Any:
    """``--page-size`` of tokenizer, executor and speculator."""
    return setting(
        PAGE_SIZE, "KV page size in tokens; tokenizer, executors and speculator must agree"
    )


def device_setting() -> Any:
    """``--device`` of the services that run a model (executor, speculator)."""
    return setting("cpu", "torch device to run the model on (cpu, cuda, cuda:1, ...)")


def port_or_off(text: str) -> int | None:
    """``--metrics-port``: a negative port (the -1 that scripts pass) means not served."""
    port = int(text)
    return None if port < 0 else port


@dataclass(frozen=True)
class NatsAuth:
    """How a service proves itself to NATS and checks the server (all optional)."""

    user: str | None = setting(None, "NATS user name", flag="--nats-user")
    password: str | None = setting(None, "NATS password", flag="--nats-password", repr=False)
    creds_file: str | None = setting(
        None, "a NATS .creds file: JWT + nkey seed", flag="--nats-creds"
    )
    nkey_seed_file: str | None = setting(None, "a NATS nkey seed file", flag="--nats-nkey-seed")
    tls_ca: str | None = setting(
        None, "verify the NATS server with this CA; turns TLS on", flag="--nats-tls-ca"
    )
    tls_cert: str | None = setting(
        None, "client certificate for mutual TLS", flag="--nats-tls-cert"
    )
    tls_key: str | None = setting(None, "client certificate's key", flag="--nats-tls-key")

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise ValueError("--nats-user and --nats-password go together")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--nats-tls-cert and --nats-tls-key go together")

    def connect_options(self, region: str = "") -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` of a service in ``region`` (empty: none)."""
        options: dict[str, Any] = {}
        if self.user is not None:
            options["user"], options["password"] = self.user, self.password
            # Replies to this user's requests come to _INBOX.<user>.*: with one NATS user per
            # service, its permissions then open only its own inbox (common/nats_permissions.py);
            # in a region _INBOX.<user>.<region>.*: the same user name in another region (each
            # region's servers have their own users) cannot read this one's replies.
            options["inbox_prefix"] = inbox_prefix(self.user, region)
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


@dataclass(frozen=True)
class MeshConfig:
    """Where the mesh is and who this service is in it: the settings every service takes."""

    nats_url: str = setting(
        "nats://127.0.0.1:4222",
        "NATS server URL; a comma-separated list for a cluster (every server of it: the "
        "client reconnects to a live one when its server goes)",
    )
    subject_prefix: str = setting(DEFAULT_PREFIX, "first token of every subject, one per mesh")
    # Regions (a NATS supercluster, docs/deploy.md): each region runs a whole mesh under its
    # own subjects (``<prefix>.<region>.*``), so heartbeats, presence, queue groups and the
    # KV-event stream stay in their region; only what a scheduler deliberately sends to
    # another region (spilled requests, ``services/scheduler/spill.py``) and the replies to a
    # gateway's inbox cross the NATS gateways.
    region: str = setting(
        "",
        "the region this service runs in (one NATS cluster of a supercluster); empty: no regions",
    )
    kv_replicas: int = setting(
        1, "replicas of the KV-event JetStream stream (3 on a 3-server NATS cluster)"
    )
    instance_id: str = setting("", "this process's id in the mesh; empty: host name + random")
    log_level: str = setting("INFO", "logging level")
    auth: NatsAuth = field(default_factory=NatsAuth)
    # Observability: traces (common/telemetry.py) and /metrics + /health for services without
    # an HTTP API of their own (common/metrics.py).
    otlp_endpoint: str = setting(
        "",
        "OTLP/HTTP base URL for traces, e.g. http://jaeger:4318; empty: the "
        "OTEL_EXPORTER_OTLP_* variables decide",
    )
    metrics_port: int | None = setting(
        None,
        "serve /metrics and /health on this port; -1: off, 0: any free port (the "
        "gateway serves them on its HTTP port anyway)",
        parse=port_or_off,
    )
    metrics_host: str = setting("0.0.0.0", "address /metrics and /health listen on")

    def __post_init__(self) -> None:
        if not self.nats_servers:
            raise ValueError("nats_url must not be empty")
        if self.region and not region_ok(self.region):
            raise ValueError(f"region {self.region!r}: lowercase letters, digits and '-' only")
        if not 1 <= self.kv_replicas <= 5:
            raise ValueError("kv_replicas must be in 1..5 (JetStream's limit)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be in 0..65535")
        # No dots: the id is one subject token (gateway.<id>.inbox), which per-service NATS
        # permissions match with a single-token wildcard (common/nats_permissions.py); a
        # dotted id would be refused its own subjects, and only warned of.
        if self.instance_id and not instance_id_ok(self.instance_id):
            raise ValueError(
                f"instance_id {self.instance_id!r}: one subject token of at most {MAX_ID_LEN} "
                "characters, no '.', '*', '>' or whitespace (e.g. gpu-1-example-com)"
            )
        if not self.instance_id:
            host = socket.gethostname().replace(".", "-")
            object.__setattr__(self, "instance_id", f"{host}-{uuid.uuid4().hex[:6]}")

    @property
    def nats_servers(self) -> list[str]:
        """Every server URL of ``nats_url`` (one, or a cluster's list)."""
        return [url.strip() for url in self.nats_url.split(",") if url.strip()]

    @property
    def subjects(self) -> Subjects:
        """This service's subjects: its region's, when it runs in one."""
        return self.subjects_of(self.region)

    def subjects_of(self, region: str) -> Subjects:
        """The subjects of the mesh in ``region`` (empty: the mesh without regions)."""
        return region_subjects(self.subject_prefix, region)


def instance_id_ok(value: str) -> bool:
    return id_ok(value) and "." not in value


def region_ok(name: str) -> bool:
    """A region name is one subject token and one NATS cluster name."""
    return 0 < len(name) <= 32 and set(name) <= REGION_CHARS


REGION_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-")
