"""Rank 0's side of a tensor-parallel group: start the other ranks, feed them every step.

Ranks 1..N-1 are child processes (``python -m gpu.parallel.worker``), each loading its shard
of the same model and a KV pool of the same page count. Each has two pipes to rank 0: on its
stdout it says once that it is ready; on its stdin rank 0 writes, before each step, the
length of the step's broadcast (0: stop). The pipe is how an idle rank waits without a
collective timing out, and how it learns that rank 0 is gone (end of file: it exits).
Every rank then receives the step in one broadcast (``gpu.parallel.step``) and runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch._C._distributed_c10d import TCPStore

from gpu.config import ModelError
from gpu.cpu_kernels import load as load_cpu_kernels
from gpu.parallel import shm
from gpu.parallel.group import ParallelGroupLost, TensorParallel
from gpu.parallel.shard import Shard

CLOSE_WAIT_S = 5.0  # how long closing waits for the ranks, all together, before it kills them


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds (the executor's model, format and KV pool settings)."""

    model: str
    world: int
    port: int = 0  # rank 0's store (RankGroup fills it in)
    device: str = "cpu"
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    num_pages: int = 1024
    page_size: int = 16
    threads: int = 1
    cpu_kernels: bool = True
    timeout_s: float = 30.0
    shared_memory: bool = True  # CPU all-reduces through gpu.parallel.shm (False: Gloo)
    shm_path: str = ""  # that mapping, made by rank 0
    warm_rows: int = 0  # the longest step: each rank builds its Triton matmuls for it first

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))

    def device_of(self, rank: int) -> torch.device:
        """One device per rank: ``cuda:i`` + rank on CUDA, the CPU for every rank else."""
        device = torch.device(self.device)
        if device.type != "cuda":
            return device
        return torch.device("cuda", (device.index or 0) + rank)


class RankGroup:
    """The running group, held by rank 0: ``comm`` is rank 0's own collectives."""

    def __init__(self, spec: RankSpec) -> None:
        if spec.world < 2:
            raise ValueError("a rank group needs a tensor-parallel size of at least 2")
        self.workers: list[subprocess.Popen[bytes]] = []
        self.spec = spec
        try:
            self._start(spec)
        except BaseException:
            self.close()
            raise

    def _start(self, spec: RankSpec) -> None:
        # The store listens before any rank starts, on a port the kernel picked: no race with
        # another executor starting at the same time.
        store = TCPStore(
            "127.0.0.1", 0, spec.world, True, timeout=datetime.timedelta(seconds=spec.timeout_s),
            wait_for_workers=False,
        )  # fmt: skip
        cpu = spec.device_of(0).type == "cpu"
        kernels = cpu and spec.cpu_kernels and load_cpu_kernels() is not None
        shm_path = shm.create(spec.world) if kernels and spec.shared_memory else ""
        spec = self.spec = dataclasses.replace(spec, port=store.port, shm_path=shm_path)
        env = dict(
            os.environ, OMP_NUM_THREADS=str(spec.threads), MESHSERVE_TP_PARENT=str(os.getpid())
        )
        for rank in range(1, spec.world):
            cmd = [sys.executable, "-m", "gpu.parallel.worker", spec.to_json(), str(rank)]
            self.workers.append(
                subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            )
        self.comm = TensorParallel.connect(
            Shard(0, spec.world), spec.port, spec.device_of(0), spec.timeout_s,
            shm_path=spec.shm_path, store=store,
        )  # fmt: skip

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Return once every rank has loaded its shard; ``ModelError`` if one failed."""
        deadline = time.monotonic() + timeout_s
        waiting = {w.stdout.fileno(): w for w in self.workers if w.stdout is not None}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise ModelError(f"tensor-parallel ranks not ready after {timeout_s:.0f} s")
            ready, _, _ = select.select(list(waiting), [], [], min(left, 1.0))
            for fd in ready:
                worker = waiting.pop(fd)
                if os.read(fd, 1) != b"R":
                    try:
                        code: int | str = worker.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        code = "none: it said something else and was killed"
                    self.close()
                    raise ModelError(
                        f"tensor-parallel rank {self.workers.index(worker) + 1} failed to "
                        f"load the model (exit {code}; its error is in the log above)"
                    )

    def _unlink(self) -> None:
        """The shared mapping's file, if the ranks never all opened it (else it is gone)."""
        if getattr(self, "spec", None) is not None and self.spec.shm_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.spec.shm_path)

    def check_alive(self) -> None:
        """Raise ``ParallelGroupLost`` if a rank has exited, found without a collective (NCCL
        would hang): before every step, and from the executor's heartbeat while it idles, so
        an idle replica with a dead rank leaves the mesh instead of taking the next request."""
        for rank, worker in enumerate(self.workers, 1):
            if worker.poll() is not None:
                self.comm.failed = RuntimeError(f"rank {rank} exited ({worker.returncode})")
                raise ParallelGroupLost(f"tensor-parallel rank {rank} exited ({worker.returncode})")

    def send_step(self, step: torch.Tensor) -> None:
        """Wake every rank with the step's length, then broadcast the step itself."""
        head = int(step.numel()).to_bytes(8, "little")
        self.check_alive()
        for rank, worker in enumerate(self.workers, 1):
            try:
                assert worker.stdin is not None
                worker.stdin.write(head)
                worker.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                self.comm.failed = exc
                raise ParallelGroupLost(f"tensor-parallel rank {rank} is gone: {exc}") from exc
        buf = step if self.comm.device.type == "cpu" else step.to(self.comm.device)
        self.comm.broadcast_(buf)

    def close(self) -> None:
        """Stop every rank (a zero length, then end of file); kill what does not exit."""
        for worker in self.workers:
            try:
                assert worker.stdin is not None
                worker.stdin.write(bytes(8))
                worker.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
        # One deadline for all: a rank stuck in a collective with a dead peer does not exit,
        # and 5 s each, one after another, outlasted the launcher's stop stage at TP=8.
        deadline = time.monotonic() + CLOSE_WAIT_S
        for worker in self.workers:
            try:
                worker.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            if worker.stdout is not None:
                worker.stdout.close()
        if hasattr(self, "comm"):
            self.comm.close()
        self._unlink()

    def mark_failed(self, exc: BaseException) -> None:
        """Rank 0 failed inside a step the others run: every later step must fail too (their
        collectives would pair with the wrong ones of ours)."""
        if hasattr(self, "comm") and self.comm.failed is None:
            self.comm.failed = exc
