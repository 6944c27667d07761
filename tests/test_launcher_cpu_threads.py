"""``meshserve up`` shares the host's cores among its CPU executors (``--cpu-threads``), and an
executor's engine thread runs with the threads it was given."""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.config import MeshConfig
from services.executor.config import ExecutorConfig
from services.executor.service import build_engine
from services.launcher.mesh import LocalMesh
from services.launcher.regions import RegionMesh
from services.launcher.up import parse_up_args


def up(*argv: str) -> argparse.Namespace:
    return parse_up_args(["--nats-url", "nats://127.0.0.1:1", *argv])  # none started


def executor_threads(mesh: LocalMesh, monkeypatch, name: str = "executor-0") -> str:
    spawned: dict[str, tuple[str, ...]] = {}
    monkeypatch.setattr(
        LocalMesh, "spawn", lambda self, n, module, *flags: spawned.update({n: flags})
    )
    mesh.start()
    flags = spawned[name]
    return flags[flags.index("--cpu-threads") + 1]


def test_cpu_executors_share_the_cores(monkeypatch, tmp_path, tiny_llama) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert executor_threads(LocalMesh(up(), tiny_llama), monkeypatch) == "0"  # one: all
    assert executor_threads(LocalMesh(up("--executors", "2"), tiny_llama), monkeypatch) == "4"
    assert executor_threads(LocalMesh(up("--executors", "16"), tiny_llama), monkeypatch) == "1"
    disagg = LocalMesh(up("--prefill-executors", "1", "--decode-executors", "3"), tiny_llama)
    assert executor_threads(disagg, monkeypatch, "decode-2") == "2"
    cuda = LocalMesh(up("--executors", "2", "--device", "cuda"), tiny_llama)
    assert executor_threads(cuda, monkeypatch) == "0"  # each has a device of its own
    # --regions on one host: two regions of two executors share the 8 cores four ways
    region = RegionMesh(up("--executors", "2"), tiny_llama, region="eu-west", peers=("us-east",))
    region.executors_on_host = 4
    assert executor_threads(region, monkeypatch, "eu-west-executor-0") == "2"


def test_the_engine_thread_runs_with_its_share(tiny_llama) -> None:
    config = ExecutorConfig(MeshConfig("nats://127.0.0.1:1"), str(tiny_llama), cpu_threads=1)
    with ThreadPoolExecutor(1) as engine_thread:  # as the executor builds and steps
        engine_thread.submit(build_engine, config).result()
        assert engine_thread.submit(torch.get_num_threads).result() == 1
    with pytest.raises(ValueError, match="cpu_threads"):
        ExecutorConfig(MeshConfig("nats://127.0.0.1:1"), str(tiny_llama), cpu_threads=-1)
