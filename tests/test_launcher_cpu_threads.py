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
from services.launcher import mesh as mesh_module
from services.launcher.mesh import LocalMesh, executor_device
from services.launcher.regions import RegionMesh
from services.launcher.up import parse_up_args


def up(*argv: str) -> argparse.Namespace:
    return parse_up_args(["--nats-url", "nats://127.0.0.1:1", *argv])  # none started


def spawned_flags(mesh: LocalMesh, monkeypatch) -> dict[str, tuple[str, ...]]:
    spawned: dict[str, tuple[str, ...]] = {}
    monkeypatch.setattr(
        LocalMesh, "spawn", lambda self, n, module, *flags: spawned.update({n: flags})
    )
    mesh.start()
    return spawned


def executor_threads(mesh: LocalMesh, monkeypatch, name: str = "executor-0") -> str:
    flags = spawned_flags(mesh, monkeypatch)[name]
    return flags[flags.index("--cpu-threads") + 1]


def test_each_executor_takes_its_own_gpus(monkeypatch, tiny_llama) -> None:
    """``--device cuda --executors 2`` put both executors on cuda:0 (only tensor-parallel
    replicas were spread); every executor now takes the next GPUs, across regions too, and
    more executors than GPUs share them round the host."""
    monkeypatch.setattr(mesh_module, "cuda_device_count", lambda: 4)

    def devices(mesh: LocalMesh) -> dict[str, str]:
        spawned = spawned_flags(mesh, monkeypatch)
        return {n: f[f.index("--device") + 1] for n, f in spawned.items() if "--device" in f}

    mesh = LocalMesh(up("--executors", "2", "--device", "cuda"), tiny_llama)
    assert devices(mesh) == {"executor-0": "cuda:0", "executor-1": "cuda:1"}
    mesh = LocalMesh(up("--executors", "3", "--device", "cuda", "--tensor-parallel-size", "2"),
                     tiny_llama)  # fmt: skip
    assert devices(mesh) == {"executor-0": "cuda:0", "executor-1": "cuda:2", "executor-2": "cuda:0"}
    region = RegionMesh(up("--executors", "2", "--device", "cuda"), tiny_llama,
                        region="eu-west", peers=("us-east",))  # fmt: skip
    region.first_executor = 2  # us-east's two come first
    assert devices(region) == {"eu-west-executor-0": "cuda:2", "eu-west-executor-1": "cuda:3"}
    assert executor_device("cuda:1", 0, 1, gpus=4) == "cuda:1"
    assert [executor_device("cuda", i, 1, gpus=3) for i in range(5)] == [
        "cuda:0", "cuda:1", "cuda:2", "cuda:0", "cuda:1"
    ]  # fmt: skip
    assert executor_device("cpu", 3, 1) == "cpu"
    # from an offset that is no multiple of the group: each group still lies on the host
    # (executor 1 of TP=2 from cuda:1 on 4 GPUs got cuda:3, its rank 1 a cuda:4 that is not)
    assert [executor_device("cuda:1", i, 2, gpus=4) for i in range(4)] == [
        "cuda:1", "cuda:0", "cuda:2", "cuda:0"
    ]  # fmt: skip
    assert [executor_device("cuda:2", i, 4, gpus=8) for i in range(3)] == [
        "cuda:2", "cuda:0", "cuda:4"
    ]  # fmt: skip


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
