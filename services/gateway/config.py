"""The gateway's settings: one frozen dataclass built once from flags and environment."""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass, field

from common.config import MeshConfig, env
from services.gateway.health import REQUIRED_STAGES, STAGES

# OpenAI's chat API defaults max_tokens to "the rest of the context". The gateway cannot count
# prompt tokens (the tokenizer does), so it sends this cap instead; see ``chat_default_max_tokens``.
CHAT_DEFAULT_MAX_TOKENS = 4096
# OpenAI allows 4 stop sequences, vLLM any number. 4 breaks clients written for vLLM (eval
# harnesses pass few-shot separators plus several end markers); 16 fits them, and the cost of
# each stop string in the detokenizer is bounded by the length caps in protocol.py.
DEFAULT_MAX_STOP = 16
DEFAULT_MAX_CLIENT_PRIORITY = 10
MAX_PRIORITY = 2**31 - 1  # what the scheduler's int field is meant to hold


@dataclass(frozen=True)
class GatewayConfig:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: str = "smollm2"
    max_model_len: int = 8192
    request_timeout_s: float = 600.0
    max_n: int = 8
    max_body_bytes: int = 4 * 1024 * 1024
    max_stop: int = DEFAULT_MAX_STOP
    max_client_priority: int = DEFAULT_MAX_CLIENT_PRIORITY
    chat_max_tokens_cap: int = CHAT_DEFAULT_MAX_TOKENS
    heartbeat_ttl_s: float = 5.0
    # Stages /health and every request need a live member of (services/gateway/health.py),
    # how long a member counts after its last presence announcement, and how long after the
    # gateway starts a missing stage is waited for rather than reported.
    required_stages: tuple[str, ...] = REQUIRED_STAGES
    presence_ttl_s: float = 3.0
    startup_grace_s: float = 3.0
    shutdown_timeout_s: float = 30.0
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: no authentication
    # Serve without API keys on a non-loopback address anyway (``parse_args`` refuses otherwise).
    allow_unauthenticated: bool = False

    def __post_init__(self) -> None:
        checks = {
            "port must be in 0..65535": 0 <= self.port <= 65535,
            "served_model_name must not be empty": bool(self.served_model_name),
            "max_model_len must be >= 2": self.max_model_len >= 2,
            "request_timeout_s must be > 0": self.request_timeout_s > 0,
            "max_n must be >= 1": self.max_n >= 1,
            "max_body_bytes must be >= 1024": self.max_body_bytes >= 1024,
            "max_stop must be >= 0": self.max_stop >= 0,
            f"max_client_priority must be in 0..{MAX_PRIORITY}": (
                0 <= self.max_client_priority <= MAX_PRIORITY
            ),
            "chat_max_tokens_cap must be >= 1": self.chat_max_tokens_cap >= 1,
            "heartbeat_ttl_s must be > 0": self.heartbeat_ttl_s > 0,
            f"required_stages must be among {', '.join(STAGES)}": set(self.required_stages)
            <= set(STAGES),
            "presence_ttl_s must be > 0": self.presence_ttl_s > 0,
            "startup_grace_s must be >= 0": self.startup_grace_s >= 0,
            "shutdown_timeout_s must be >= 0": self.shutdown_timeout_s >= 0,
        }
        failed = [message for message, ok in checks.items() if not ok]
        if failed:
            raise ValueError("; ".join(failed))

    @property
    def max_completion_tokens(self) -> int:
        """The largest max_tokens any request may ask for (the prompt takes at least one)."""
        return self.max_model_len - 1

    @property
    def chat_default_max_tokens(self) -> int:
        """max_tokens for a chat request that sets none: the context minus one, capped.

        vLLM uses max_model_len - prompt_len here; the gateway does not know prompt_len, so it
        caps the default instead, and a later stage that knows the prompt length should clamp
        it to the remaining context rather than reject it.
        """
        return min(self.max_completion_tokens, self.chat_max_tokens_cap)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.gateway", description="meshserve OpenAI-compatible HTTP gateway"
    )
    MeshConfig.add_args(parser)
    parser.add_argument("--host", default=env("HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(env("PORT", "8000")))
    parser.add_argument("--served-model-name", default=env("SERVED_MODEL_NAME", "smollm2"))
    parser.add_argument("--max-model-len", type=int, default=int(env("MAX_MODEL_LEN", "8192")))
    parser.add_argument(
        "--request-timeout-s", type=float, default=float(env("REQUEST_TIMEOUT_S", "600"))
    )
    parser.add_argument("--max-n", type=int, default=int(env("MAX_N", "8")))
    parser.add_argument(
        "--max-body-bytes", type=int, default=int(env("MAX_BODY_BYTES", str(4 * 1024 * 1024)))
    )
    parser.add_argument(
        "--max-stop",
        type=int,
        default=int(env("MAX_STOP", str(DEFAULT_MAX_STOP))),
        help="most stop sequences a request may set (OpenAI allows 4)",
    )
    parser.add_argument(
        "--max-client-priority",
        type=int,
        default=int(env("MAX_CLIENT_PRIORITY", str(DEFAULT_MAX_CLIENT_PRIORITY))),
        metavar="P",
        help="a request's 'priority' must be an integer in -P..P; as in vLLM, a lower value "
        "runs first and the default 0 is in the middle; 0 disables client priorities (any "
        "non-zero priority is rejected)",
    )
    parser.add_argument(
        "--chat-max-tokens-cap",
        type=int,
        default=int(env("CHAT_MAX_TOKENS_CAP", str(CHAT_DEFAULT_MAX_TOKENS))),
        help="cap on the default max_tokens of a chat request that sets none",
    )
    parser.add_argument(
        "--heartbeat-ttl-s",
        type=float,
        default=float(env("HEARTBEAT_TTL_S", "5")),
        help="/health fails when no executor heartbeat arrived for this long",
    )
    parser.add_argument(
        "--required-stages",
        default=env("REQUIRED_STAGES", ",".join(REQUIRED_STAGES)),
        help=f"comma-separated stages that must have a live member (of {', '.join(STAGES)})",
    )
    parser.add_argument(
        "--presence-ttl-s",
        type=float,
        default=float(env("PRESENCE_TTL_S", "3")),
        help="a service counts as gone this long after its last presence announcement",
    )
    parser.add_argument(
        "--startup-grace-s",
        type=float,
        default=float(env("STARTUP_GRACE_S", "3")),
        help="after start, requests wait this long for a missing stage to announce itself",
    )
    parser.add_argument(
        "--shutdown-timeout-s", type=float, default=float(env("SHUTDOWN_TIMEOUT_S", "30"))
    )
    parser.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        default=None,
        help="accepted bearer token (repeatable; env MESHSERVE_API_KEYS, comma-separated)",
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=env("ALLOW_UNAUTHENTICATED", "").lower() in ("1", "true", "yes"),
        help="serve /v1/* and /metrics without API keys on a non-loopback --host (refused "
        "otherwise: anyone who reaches the port could use the API)",
    )
    return parser


def unauthenticated_exposure(config: GatewayConfig) -> str | None:
    """Why serving ``config`` would open the API to anyone who reaches it (None: it would not)."""
    if config.api_keys or config.allow_unauthenticated or is_loopback(config.host):
        return None
    return (
        f"refusing to serve without API keys on {config.host}: set MESHSERVE_API_KEYS "
        "(or --api-key), bind --host 127.0.0.1, or pass --allow-unauthenticated "
        "(MESHSERVE_ALLOW_UNAUTHENTICATED=1)"
    )


def serving_config(argv: list[str] | None = None) -> GatewayConfig:
    """``parse_args``, then refuse (exit 2, as argparse does) a config that must not be served:
    what ``python -m services.gateway`` starts from. Open by default is how an inference API
    ends up serving the internet, so leaving it open has to be an explicit choice."""
    config = parse_args(argv)
    problem = unauthenticated_exposure(config)
    if problem is not None:
        build_parser().error(problem)
    return config


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    args = build_parser().parse_args(argv)
    keys = args.api_keys or [k for k in env("API_KEYS", "").split(",") if k.strip()]
    return GatewayConfig(
        mesh=MeshConfig.from_args(args),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        request_timeout_s=args.request_timeout_s,
        max_n=args.max_n,
        max_body_bytes=args.max_body_bytes,
        max_stop=args.max_stop,
        max_client_priority=args.max_client_priority,
        chat_max_tokens_cap=args.chat_max_tokens_cap,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        required_stages=tuple(s.strip() for s in args.required_stages.split(",") if s.strip()),
        presence_ttl_s=args.presence_ttl_s,
        startup_grace_s=args.startup_grace_s,
        shutdown_timeout_s=args.shutdown_timeout_s,
        api_keys=tuple(k.strip() for k in keys),
        allow_unauthenticated=args.allow_unauthenticated,
    )
