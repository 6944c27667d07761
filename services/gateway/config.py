"""The gateway's settings: one frozen dataclass built once from flags and environment."""

from __future__ import annotations

import argparse
import functools
import ipaddress
from dataclasses import dataclass, field

from common import settings
from common.config import MeshConfig, lora_modules_setting, parse_lora_modules
from common.reasoning import PARSERS as REASONING_PARSERS
from common.settings import setting
from common.wire.tokenizer import MAX_CHOICES
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
    host: str = setting("0.0.0.0", "address the HTTP API listens on")
    port: int = setting(8000, "port of the HTTP API (and its /metrics and /health)")
    served_model_name: str = setting("smollm2", "the model name clients send")
    max_model_len: int = setting(8192, "context length accepted: prompt + max_tokens")
    request_timeout_s: float = setting(600.0, "a request's deadline, in seconds")
    max_n: int = setting(8, "most completions one request may ask for (n)")
    max_batch_choices: int = setting(
        64, "most choices (prompts x n) a completions request that batches prompts may ask for"
    )
    max_embedding_inputs: int = setting(
        2048, "most inputs one /v1/embeddings request may batch (OpenAI's limit)"
    )
    embedding_concurrency: int = setting(
        64,
        "most inputs of one /v1/embeddings request in the mesh at once (the next is sent as "
        "one finishes)",
    )
    lora_modules: tuple[str, ...] = lora_modules_setting()
    allow_runtime_lora_updating: bool = setting(
        False,
        "serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (each live executor "
        "loads the PEFT folder a client names: give clients access only where they may read "
        "the executors' disks)",
    )
    # The adapters live executors announce (``Heartbeat.loras``): models too (no flag; the
    # gateway fills it in as they come: ``Routes.config``).
    announced_loras: tuple[str, ...] = ()
    reasoning_parser: str = setting(
        "none",
        "split a chat answer's <think> block into 'reasoning' (and 'reasoning_content'), as "
        "vLLM's --reasoning-parser: deepseek_r1 or qwen3 (both read <think>...</think>; the "
        "prompt's end says whether the answer starts inside the block); none: off",
        choices=("none", *REASONING_PARSERS),
    )
    max_body_bytes: int = setting(4 * 1024 * 1024, "largest request body accepted")
    max_stop: int = setting(
        DEFAULT_MAX_STOP, "most stop sequences a request may set (OpenAI allows 4)"
    )
    max_client_priority: int = setting(
        DEFAULT_MAX_CLIENT_PRIORITY,
        "a request's 'priority' must be an integer in -P..P; as in vLLM, a lower value "
        "runs first and the default 0 is in the middle; 0 disables client priorities (any "
        "non-zero priority is rejected)",
        metavar="P",
    )
    chat_max_tokens_cap: int = setting(
        CHAT_DEFAULT_MAX_TOKENS, "cap on the default max_tokens of a chat request that sets none"
    )
    heartbeat_ttl_s: float = setting(
        5.0, "/health fails when no executor heartbeat arrived for this long"
    )
    # Stages /health and every request need a live member of (services/gateway/health.py),
    # how long a member counts after its last presence announcement, and how long after the
    # gateway starts a missing stage is waited for rather than reported.
    required_stages: tuple[str, ...] = setting(
        REQUIRED_STAGES, f"stages that must have a live member, of {', '.join(STAGES)}"
    )
    presence_ttl_s: float = setting(
        3.0, "a service counts as gone this long after its last presence announcement"
    )
    startup_grace_s: float = setting(
        3.0, "after start, requests wait this long for a missing stage to announce itself"
    )
    shutdown_timeout_s: float = setting(
        30.0, "on SIGTERM, requests in flight get this long to finish"
    )
    http_idle_timeout_s: float = setting(
        30.0,
        "a connection that has not sent a whole request line and headers this long after it "
        "opened or its last response ended is closed (a client that never finishes its "
        "headers holds no connection for long); requests in flight are never cut",
    )
    max_resumes: int = setting(
        3,
        "times one choice whose tokens were lost in transit (a NATS server died with them) "
        "is resumed as a continuation before it fails with a retryable 503; 0: never",
    )
    api_keys: tuple[str, ...] = setting(
        (),
        "bearer tokens accepted on /v1/* and /metrics (none: no authentication)",
        flag="--api-key",
        env="MESHSERVE_API_KEYS",
        repr=False,
    )
    # Serve without API keys on a non-loopback address anyway (``serving_config`` refuses
    # otherwise).
    allow_unauthenticated: bool = setting(
        False,
        "serve /v1/* and /metrics without API keys on a non-loopback --host (refused "
        "otherwise: anyone who reaches the port could use the API)",
    )

    @functools.cached_property
    def lora_paths(self) -> dict[str, str]:
        """``--lora-modules`` as {name: folder} (parsed once: the settings never change)."""
        return parse_lora_modules(self.lora_modules)

    @functools.cached_property
    def lora_names(self) -> list[str]:
        """The LoRA adapters' names: models a request may name besides the served one (those
        of ``--lora-modules``, then those the executors announce)."""
        names = list(self.lora_paths)
        return names + [n for n in self.announced_loras if n not in names]

    def __post_init__(self) -> None:
        if self.served_model_name in self.lora_names:
            raise ValueError("a LoRA adapter may not take the served model's name")
        checks = {
            "port must be in 0..65535": 0 <= self.port <= 65535,
            "served_model_name must not be empty": bool(self.served_model_name),
            "max_model_len must be >= 2": self.max_model_len >= 2,
            "request_timeout_s must be > 0": self.request_timeout_s > 0,
            f"max_n must be within 1..{MAX_CHOICES}": 1 <= self.max_n <= MAX_CHOICES,
            "max_batch_choices must be >= 1": self.max_batch_choices >= 1,
            "max_embedding_inputs must be >= 1": self.max_embedding_inputs >= 1,
            "embedding_concurrency must be >= 1": self.embedding_concurrency >= 1,
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
            "http_idle_timeout_s must be > 0": self.http_idle_timeout_s > 0,
            "max_resumes must be >= 0": self.max_resumes >= 0,
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
    return settings.build_parser(
        GatewayConfig,
        prog="python -m services.gateway",
        description="meshserve OpenAI-compatible HTTP gateway",
    )


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
    return settings.from_args(GatewayConfig, build_parser().parse_args(argv))
