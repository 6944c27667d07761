from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.config import MeshConfig, env
from gpu.formats import KV_CACHE_DTYPES, QUANTIZATIONS

SPECULATORS = ("off", "ngram", "remote")


@dataclass(frozen=True)
class ExecutorConfig:
    mesh: MeshConfig
    model: str | None
    device: str = "cpu"
    page_size: int = 16
    kv_cache_tokens: int = 16384
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    heartbeat_s: float = 0.25
    # Speculative decoding: "off", "ngram" (prompt lookup, in process) or "remote" (the
    # speculator service's draft model); k draft tokens per decode step at most.
    speculator: str = "off"
    num_speculative_tokens: int = 0
    speculator_timeout_s: float = 2.0
    quantization: str = "none"  # weight format: none | int8 | fp8 (gpu.quant)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8
    # Niceness added to the engine thread (and the OpenMP threads it starts): the mesh's light
    # services on the same host then preempt the model at once instead of waiting for a time
    # slice, which is most of the TTFT the mesh would add on a busy CPU. 0 for dedicated cores.
    engine_nice: int = 10

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.speculator not in SPECULATORS:
            raise ValueError(f"speculator must be one of {', '.join(SPECULATORS)}")
        if self.speculator != "off" and self.num_speculative_tokens < 1:
            raise ValueError("a speculator needs --num-speculative-tokens >= 1")
        if self.kv_cache_tokens < self.page_size:
            raise ValueError("kv_cache_tokens must hold at least one page")
        if not 0 <= self.engine_nice <= 19:
            raise ValueError("engine_nice must be within 0..19")

    @property
    def executor_id(self) -> str:
        return self.mesh.instance_id

    @property
    def num_pages(self) -> int:
        return self.kv_cache_tokens // self.page_size


def parse_args(argv: list[str] | None = None) -> ExecutorConfig:
    p = argparse.ArgumentParser("python -m services.executor")
    MeshConfig.add_args(p)
    p.add_argument("--model", default=env("MODEL", "") or None)
    p.add_argument("--device", default=env("DEVICE", "cpu"))
    p.add_argument("--page-size", type=int, default=int(env("PAGE_SIZE", "16")))
    p.add_argument("--kv-cache-tokens", type=int, default=int(env("KV_CACHE_TOKENS", "16384")))
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=int(env("MAX_NUM_BATCHED_TOKENS", "512"))
    )
    p.add_argument("--max-num-seqs", type=int, default=int(env("MAX_NUM_SEQS", "64")))
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--speculator", choices=SPECULATORS, default=env("SPECULATOR", "off"))
    p.add_argument(
        "--num-speculative-tokens", type=int, default=int(env("NUM_SPECULATIVE_TOKENS", "0"))
    )
    p.add_argument(
        "--speculator-timeout", type=float, default=float(env("SPECULATOR_TIMEOUT", "2.0"))
    )
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=env("QUANTIZATION", "none"))
    p.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=env("KV_CACHE_DTYPE", "auto")
    )
    p.add_argument(
        "--engine-nice",
        type=int,
        default=int(env("ENGINE_NICE", "10")),
        help="niceness added to the engine's threads (0..19; see ExecutorConfig)",
    )
    a = p.parse_args(argv)
    return ExecutorConfig(
        mesh=MeshConfig.from_args(a),
        model=a.model,
        device=a.device,
        page_size=a.page_size,
        kv_cache_tokens=a.kv_cache_tokens,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        enable_prefix_caching=not a.no_prefix_caching,
        speculator=a.speculator,
        num_speculative_tokens=a.num_speculative_tokens if a.speculator != "off" else 0,
        speculator_timeout_s=a.speculator_timeout,
        quantization=a.quantization,
        kv_cache_dtype=a.kv_cache_dtype,
        engine_nice=a.engine_nice,
    )
