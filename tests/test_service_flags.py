"""Every service's command line and ``MESHSERVE_*`` variables, pinned.

Users, compose.yaml, the README and scripts spell these names; a refactoring of how parsers are
built must not lose or rename one. The tables were written down from the hand-written parsers
before their derivation from the config dataclasses, and each row is checked from outside:

- the flags in ``--help``'s usage line are exactly the table's, and the help names each
  flag's variable;
- the ``MESHSERVE_*`` variables a parse looks up are exactly the table's;
- each variable backs its own flag: setting the variable to the row's sample value gives the
  same config as passing the flag with it, and a config other than the default one.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections.abc import Callable
from typing import Any

import pytest

from tests.environ import RecordingEnviron

# (flag, environment variable, a sample value that is not the default; None: a switch)
Row = tuple[str, str, str | None]

MESH: list[Row] = [
    ("--nats-url", "MESHSERVE_NATS_URL", "nats://h:1"),
    ("--subject-prefix", "MESHSERVE_SUBJECT_PREFIX", "other"),
    ("--region", "MESHSERVE_REGION", "eu-west"),
    ("--kv-replicas", "MESHSERVE_KV_REPLICAS", "3"),
    ("--instance-id", "MESHSERVE_INSTANCE_ID", "pinned-1"),
    ("--log-level", "MESHSERVE_LOG_LEVEL", "DEBUG"),
    ("--nats-user", "MESHSERVE_NATS_USER", "u1"),
    ("--nats-password", "MESHSERVE_NATS_PASSWORD", "p1"),
    ("--nats-creds", "MESHSERVE_NATS_CREDS", "/x.creds"),
    ("--nats-nkey-seed", "MESHSERVE_NATS_NKEY_SEED", "/x.nk"),
    ("--nats-tls-ca", "MESHSERVE_NATS_TLS_CA", "/ca.pem"),
    ("--nats-tls-cert", "MESHSERVE_NATS_TLS_CERT", "/c1.pem"),
    ("--nats-tls-key", "MESHSERVE_NATS_TLS_KEY", "/k1.pem"),
    ("--otlp-endpoint", "MESHSERVE_OTLP_ENDPOINT", "http://jaeger:4318"),
    ("--metrics-port", "MESHSERVE_METRICS_PORT", "9100"),
    ("--metrics-host", "MESHSERVE_METRICS_HOST", "127.0.0.1"),
]

SERVICES: dict[str, list[Row]] = {
    "services.tokenizer.service": [
        ("--model", "MESHSERVE_MODEL", "m"),
        ("--page-size", "MESHSERVE_PAGE_SIZE", "32"),
        ("--detok-shards", "MESHSERVE_DETOK_SHARDS", "4"),
        ("--generation-config", "MESHSERVE_GENERATION_CONFIG", "none"),
    ],
    "services.scheduler.service": [
        ("--router", "MESHSERVE_ROUTER", "kv"),
        ("--max-queue", "MESHSERVE_MAX_QUEUE", "7"),
        ("--heartbeat-timeout", "MESHSERVE_HEARTBEAT_TIMEOUT", "3.5"),
        ("--overlap-weight", "MESHSERVE_OVERLAP_WEIGHT", "1.5"),
        ("--max-imbalance", "MESHSERVE_MAX_IMBALANCE", "64"),
        ("--index-timeout", "MESHSERVE_INDEX_TIMEOUT", "0.3"),
        ("--migration-limit", "MESHSERVE_MIGRATION_LIMIT", "0"),
        ("--priority-aging", "MESHSERVE_PRIORITY_AGING", "2.5"),
        ("--disagg-min-prompt-tokens", "MESHSERVE_DISAGG_MIN_PROMPT_TOKENS", "256"),
        ("--peer-regions", "MESHSERVE_PEER_REGIONS", "eu-west"),
        ("--spill-queue-ms", "MESHSERVE_SPILL_QUEUE_MS", "250"),
        ("--prefill-ms-per-token", "MESHSERVE_PREFILL_MS_PER_TOKEN", "0.5"),
        ("--spill-reserve-seqs", "MESHSERVE_SPILL_RESERVE_SEQS", "2"),
        ("--spill-reserve-executors", "MESHSERVE_SPILL_RESERVE_EXECUTORS", "2"),
    ],
    "services.detokenizer.service": [
        ("--model", "MESHSERVE_MODEL", "m"),
        ("--shard", "MESHSERVE_DETOK_SHARD", "2"),
    ],
    "services.prefix_index.service": [
        ("--executor-timeout", "MESHSERVE_INDEX_EXECUTOR_TIMEOUT", "12"),
    ],
    "services.speculator.service": [
        ("--draft-model", "MESHSERVE_DRAFT_MODEL", "d2"),
        ("--device", "MESHSERVE_DEVICE", "cuda"),
        ("--page-size", "MESHSERVE_PAGE_SIZE", "32"),
        ("--kv-cache-tokens", "MESHSERVE_DRAFT_KV_CACHE_TOKENS", "4096"),
        ("--top-n", "MESHSERVE_DRAFT_TOP_N", "8"),
    ],
    "services.executor.config": [
        ("--model", "MESHSERVE_MODEL", "m"),
        ("--device", "MESHSERVE_DEVICE", "cuda"),
        ("--page-size", "MESHSERVE_PAGE_SIZE", "32"),
        ("--kv-cache-tokens", "MESHSERVE_KV_CACHE_TOKENS", "4096"),
        ("--max-num-batched-tokens", "MESHSERVE_MAX_NUM_BATCHED_TOKENS", "256"),
        ("--max-num-seqs", "MESHSERVE_MAX_NUM_SEQS", "8"),
        # The one flag without a variable before the parsers were derived: added, so that
        # every flag has a variable, as the README says.
        ("--no-prefix-caching", "MESHSERVE_NO_PREFIX_CACHING", None),
        ("--speculator", "MESHSERVE_SPECULATOR", "remote"),
        ("--num-speculative-tokens", "MESHSERVE_NUM_SPECULATIVE_TOKENS", "5"),
        ("--speculator-timeout", "MESHSERVE_SPECULATOR_TIMEOUT", "0.5"),
        ("--quantization", "MESHSERVE_QUANTIZATION", "int8"),
        ("--no-cuda-graphs", "MESHSERVE_NO_CUDA_GRAPHS", None),
        ("--overlap-steps", "MESHSERVE_OVERLAP_STEPS", "on"),
        ("--logprobs-mode", "MESHSERVE_LOGPROBS_MODE", "processed"),
        ("--fused-rope-append", "MESHSERVE_FUSED_ROPE_APPEND", None),
        ("--triton-gemv", "MESHSERVE_TRITON_GEMV", "layers"),
        ("--kv-cache-dtype", "MESHSERVE_KV_CACHE_DTYPE", "fp8"),
        ("--engine-nice", "MESHSERVE_ENGINE_NICE", "0"),
        ("--cpu-threads", "MESHSERVE_CPU_THREADS", "2"),
        ("--tensor-parallel-size", "MESHSERVE_TENSOR_PARALLEL_SIZE", "2"),
        ("--tensor-parallel-timeout", "MESHSERVE_TENSOR_PARALLEL_TIMEOUT", "5"),
        ("--role", "MESHSERVE_ROLE", "decode"),
        ("--lora-modules", "MESHSERVE_LORA_MODULES", "a=/x"),
        ("--kv-transfer-timeout", "MESHSERVE_KV_TRANSFER_TIMEOUT", "5"),
    ],
    "services.gateway.config": [
        ("--host", "MESHSERVE_HOST", "127.0.0.1"),
        ("--port", "MESHSERVE_PORT", "9000"),
        ("--served-model-name", "MESHSERVE_SERVED_MODEL_NAME", "m"),
        ("--max-model-len", "MESHSERVE_MAX_MODEL_LEN", "128"),
        ("--request-timeout-s", "MESHSERVE_REQUEST_TIMEOUT_S", "5"),
        ("--max-n", "MESHSERVE_MAX_N", "2"),
        ("--max-batch-choices", "MESHSERVE_MAX_BATCH_CHOICES", "16"),
        ("--max-embedding-inputs", "MESHSERVE_MAX_EMBEDDING_INPUTS", "16"),
        ("--embedding-concurrency", "MESHSERVE_EMBEDDING_CONCURRENCY", "4"),
        ("--reasoning-parser", "MESHSERVE_REASONING_PARSER", "qwen3"),
        ("--lora-modules", "MESHSERVE_LORA_MODULES", "a=/x"),
        ("--allow-runtime-lora-updating", "MESHSERVE_ALLOW_RUNTIME_LORA_UPDATING", None),
        ("--max-body-bytes", "MESHSERVE_MAX_BODY_BYTES", "4096"),
        ("--max-stop", "MESHSERVE_MAX_STOP", "4"),
        ("--max-client-priority", "MESHSERVE_MAX_CLIENT_PRIORITY", "3"),
        ("--chat-max-tokens-cap", "MESHSERVE_CHAT_MAX_TOKENS_CAP", "100"),
        ("--heartbeat-ttl-s", "MESHSERVE_HEARTBEAT_TTL_S", "1.5"),
        ("--required-stages", "MESHSERVE_REQUIRED_STAGES", "tokenizer"),
        ("--presence-ttl-s", "MESHSERVE_PRESENCE_TTL_S", "1.5"),
        ("--startup-grace-s", "MESHSERVE_STARTUP_GRACE_S", "0.5"),
        ("--shutdown-timeout-s", "MESHSERVE_SHUTDOWN_TIMEOUT_S", "5"),
        ("--http-idle-timeout-s", "MESHSERVE_HTTP_IDLE_TIMEOUT_S", "5"),
        ("--max-resumes", "MESHSERVE_MAX_RESUMES", "0"),
        ("--api-key", "MESHSERVE_API_KEYS", "k1"),
        ("--allow-unauthenticated", "MESHSERVE_ALLOW_UNAUTHENTICATED", None),
    ],
}

# Settings every parse starts from, so each row's sample is valid on its own: a user needs a
# password (and a certificate a key), the speculator a draft model, and the executor's draft
# length only counts with a speculator on.
BASE_ENV = {
    "MESHSERVE_NATS_USER": "u0",
    "MESHSERVE_NATS_PASSWORD": "p0",
    "MESHSERVE_NATS_TLS_CERT": "/c0.pem",
    "MESHSERVE_NATS_TLS_KEY": "/k0.pem",
}
SERVICE_ENV = {
    "services.speculator.service": {"MESHSERVE_DRAFT_MODEL": "d"},
    "services.executor.config": {
        "MESHSERVE_SPECULATOR": "ngram",
        "MESHSERVE_NUM_SPECULATIVE_TOKENS": "2",
    },
}


def rows(module: str) -> list[Row]:
    return MESH + SERVICES[module]


def parser_of(module: str) -> Callable[[list[str]], Any]:
    parse: Callable[[list[str]], Any] = importlib.import_module(module).parse_args
    return parse


def parse(
    module: str, argv: list[str], environ: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, set[str]]:
    recording = RecordingEnviron(BASE_ENV | SERVICE_ENV.get(module, {}) | environ)
    monkeypatch.setattr(os, "environ", recording)
    try:
        return parser_of(module)(argv), recording.read
    finally:
        monkeypatch.undo()


def fingerprint(config: Any, keep_instance_id: bool) -> dict[str, Any]:
    values = dataclasses.asdict(config)
    if not keep_instance_id:  # drawn at random when not set
        del values["mesh"]["instance_id"]
    return values


@pytest.mark.parametrize("module", SERVICES)
def test_the_flags_are_exactly_the_pinned_ones(module, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exited:
        parse(module, ["--help"], {}, monkeypatch)
    assert exited.value.code == 0
    text = capsys.readouterr().out
    usage = text.split("\n\n")[0]
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", usage))
    assert flags == {flag for flag, _, _ in rows(module)}
    # --help tells each flag's variable, and its default.
    text = " ".join(text.split())
    for _, variable, _ in rows(module):
        assert variable in text
    assert "NATS server URL; a comma-separated list for a cluster" in text
    assert "(default: nats://127.0.0.1:4222; env MESHSERVE_NATS_URL)" in text


@pytest.mark.parametrize("module", SERVICES)
def test_the_environment_variables_are_exactly_the_pinned_ones(module, monkeypatch):
    _, read = parse(module, [], {}, monkeypatch)
    expected = {variable for _, variable, _ in rows(module)}
    assert {name for name in read if name.startswith("MESHSERVE_")} == expected


@pytest.mark.parametrize(
    ("module", "row"), [(module, row) for module in SERVICES for row in rows(module)]
)
def test_each_variable_backs_its_flag(module, row, monkeypatch):
    flag, variable, sample = row
    keep = flag == "--instance-id"
    default, _ = parse(module, [], {}, monkeypatch)
    from_flag, _ = parse(module, [flag] if sample is None else [flag, sample], {}, monkeypatch)
    assert fingerprint(from_flag, keep) != fingerprint(default, keep), f"{flag} changes nothing"
    from_env, _ = parse(module, [], {variable: sample or "1"}, monkeypatch)
    assert fingerprint(from_env, keep) == fingerprint(from_flag, keep)
