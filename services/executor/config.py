from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.config import MeshConfig, env


@dataclass(frozen=True)
class ExecutorConfig:
    mesh: MeshConfig
    model: str | None
    device: str = "cpu"
    page_size: int = 16
    kv_cache_tokens: int = 65536
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    detok_shards: int = 1
    heartbeat_s: float = 0.25

    def __post_init__(self) -> None:
        if self.kv_cache_tokens < self.page_size:
            raise ValueError("kv_cache_tokens must hold at least one page")
        if self.detok_shards < 1:
            raise ValueError("detok_shards must be >= 1")

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
    p.add_argument("--kv-cache-tokens", type=int, default=int(env("KV_CACHE_TOKENS", "65536")))
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=int(env("MAX_NUM_BATCHED_TOKENS", "512"))
    )
    p.add_argument("--max-num-seqs", type=int, default=int(env("MAX_NUM_SEQS", "64")))
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--detok-shards", type=int, default=int(env("DETOK_SHARDS", "1")))
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
        detok_shards=a.detok_shards,
    )
