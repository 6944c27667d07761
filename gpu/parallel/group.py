"""One rank's collectives in a tensor-parallel group: what the model calls during a step.

The group is a ``torch.distributed`` process group built directly (a ``TCPStore`` on rank 0
and a Gloo group on CPU, NCCL on CUDA), not the global default group: a process may hold
more than one (tests run several engines in one interpreter), and nothing else in the
process is touched.

A collective that fails (a rank died: Gloo sees the connection close at once; a rank that
hangs: after ``timeout_s``) raises ``ParallelGroupLost``; the group is unusable afterwards
and its owner gives its requests up (the executor leaves the mesh: they migrate).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore
from torch.distributed import distributed_c10d as c10d

from gpu.cpu_kernels import load as load_cpu_kernels
from gpu.parallel.shard import Shard
from gpu.parallel.shm import ShmAllReduce


class ParallelGroupLost(RuntimeError):
    """A rank of the tensor-parallel group died or stopped answering."""


# int reduce(int64* ctx, float* data, int64 n): the fused CPU decode step's all-reduce hook
# (decoder.c), here the Gloo path through Python.
REDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class TensorParallel:
    def __init__(
        self, shard: Shard, group: Any, device: torch.device, shm: ShmAllReduce | None = None
    ) -> None:
        self.shard = shard
        self.group = group
        self.device = device
        self.shm = shm  # all-reduces of CPU fp32 tensors, where the ranks share a host
        self.failed: BaseException | None = None
        self._comm_ns = 0  # Gloo's share of comm_ns
        self._collectives = 0
        self._reduce_fn = REDUCE_FN(self._reduce_raw)

    @property
    def comm_ns(self) -> int:
        """Time this rank spent in collectives since it joined (waits for the others
        included): what a step pays for being split. Benchmarks read it."""
        return self._comm_ns + (self.shm.time_ns if self.shm is not None else 0)

    @property
    def num_collectives(self) -> int:
        return self._collectives + (self.shm.calls if self.shm is not None else 0)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world(self) -> int:
        return self.shard.world

    @classmethod
    def connect(
        cls,
        shard: Shard,
        port: int,
        device: torch.device | str = "cpu",
        timeout_s: float = 30.0,
        host: str = "127.0.0.1",
        shm_path: str = "",
        store: Any = None,
    ) -> TensorParallel:
        """Join the group whose store rank 0 serves on ``host:port`` (rank 0 creates it);
        returns once every rank has joined (or raises after ``timeout_s``). ``shm_path``:
        the shared mapping of ``gpu.parallel.shm`` (CPU ranks on one host), "" for none;
        ``store``: rank 0's store, already listening (else one is made on ``port``)."""
        device = torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if store is None:
                store = TCPStore(host, port, shard.world, shard.rank == 0, timeout=timeout)
            group: Any
            if device.type == "cuda":
                torch.cuda.set_device(device)  # NCCL binds each rank's communicator to it
                # wait() then raises when a peer is gone, rather than only ordering the stream
                os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
                opts = c10d.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                group = c10d.ProcessGroupNCCL(store, shard.rank, shard.world, opts)
            else:
                gloo = c10d.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                gloo._timeout = timeout
                gloo._devices = [c10d.ProcessGroupGloo.create_device(hostname=host)]
                group = c10d.ProcessGroupGloo(store, shard.rank, shard.world, gloo)
        except (RuntimeError, dist.DistError) as exc:
            raise ParallelGroupLost(
                f"tensor-parallel rank {shard.rank}: cannot join: {exc}"
            ) from exc
        shm = None
        if shm_path and device.type == "cpu":
            kernels = load_cpu_kernels()
            if kernels is None:  # every rank must take the same path, or both wait forever
                raise ParallelGroupLost(
                    f"tensor-parallel rank {shard.rank}: the shared-memory all-reduce needs "
                    "the CPU kernels, which did not load here"
                )
            shm = ShmAllReduce(kernels, shm_path, shard.rank, shard.world, timeout_s)
            # Once every rank has it mapped the file can go: nothing is left in /dev/shm
            # whatever happens to the processes later.
            try:
                group.allreduce([torch.zeros(1)]).wait()
            except RuntimeError as exc:
                raise ParallelGroupLost(f"tensor-parallel rank {shard.rank}: {exc}") from exc
            if shard.rank == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(shm_path)
        return cls(shard, group, device, shm)

    def _run(self, what: str, start: Callable[[], dist.Work]) -> None:
        """Start one Gloo/NCCL collective and wait for it, timed and counted."""
        began = time.perf_counter_ns()
        try:
            start().wait()
        except RuntimeError as exc:
            self.failed = exc
            raise ParallelGroupLost(
                f"tensor-parallel {what} failed on rank {self.rank} of {self.world}: {exc}"
            ) from exc
        self._comm_ns += time.perf_counter_ns() - began
        self._collectives += 1

    def _check(self) -> None:
        if self.failed is not None:
            raise ParallelGroupLost(f"tensor-parallel group lost earlier: {self.failed}")

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place (every rank gets the same bits)."""
        self._check()
        shm = self.shm
        if shm is not None and tensor.dtype == torch.float32 and tensor.is_contiguous():
            if not shm.all_reduce_(tensor):  # (it times itself)
                raise self.lost(RuntimeError("shared-memory all-reduce"))
            return
        self._run("all-reduce", lambda: self.group.allreduce([tensor]))

    def broadcast_(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` into every rank's (same shape and dtype)."""
        self._check()
        self._run("broadcast", lambda: self.group.broadcast(tensor, 0))

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """Logits ``[T, shard]`` of each rank's vocabulary rows -> ``[T, vocab]`` on rank 0
        (None elsewhere). Shards are ``ceil(vocab / world)`` wide; a short last one is
        padded for the collective and the padding cut off."""
        self._check()
        per = -(-vocab // self.world)
        if local.shape[1] < per:
            local = torch.nn.functional.pad(local, (0, per - local.shape[1]))
        local = local.contiguous()
        if self.device.type == "cuda":  # NCCL: every rank gets them
            parts = [torch.empty_like(local) for _ in range(self.world)]
            self._run("all-gather", lambda: self.group.allgather([parts], [local]))
        else:
            opts = dist.GatherOptions()
            opts.rootRank = 0
            parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else []
            self._run("gather", lambda: self.group.gather([parts] if parts else [], [local], opts))
        if self.rank != 0:
            return None
        return torch.cat(parts, dim=1)[:, :vocab]

    def _reduce_raw(self, ctx: int, pointer: int, n: int) -> int:
        # Called from C (ctypes takes the GIL); an exception cannot cross back into C: it is
        # kept in ``failed``, and the nonzero return ends the C call.
        if self.failed is not None:
            return -1
        try:
            buf = (ctypes.c_float * n).from_address(pointer)
            self.all_reduce_(torch.frombuffer(buf, dtype=torch.float32))
        except BaseException as exc:  # must not unwind through C
            self.failed = exc
            return -1
        return 0

    def reduce_hook(self) -> tuple[int, int]:
        """(address of ``int fn(int64* ctx, float* data, int64 n)``, ctx) that all-reduces
        in place, for the fused decode step: shared memory's C function where the ranks
        have it (no Python between the layers), else a callback into Gloo."""
        if self.shm is not None:
            return self.shm.hook()
        address = ctypes.cast(self._reduce_fn, ctypes.c_void_p).value
        assert address is not None
        return address, 0

    def lost(self, cause: BaseException) -> ParallelGroupLost:
        """The error for an all-reduce that failed outside Gloo (in shared memory, or in the
        fused step's hook); the group counts as failed from now on."""
        if self.failed is None:
            rank = self.shm.lost_rank if self.shm is not None else None
            self.failed = (
                cause if rank is None else RuntimeError(f"rank {rank} died or passed the timeout")
            )
        return ParallelGroupLost(
            f"tensor-parallel all-reduce failed on rank {self.rank} of {self.world}: {self.failed}"
        )

    def close(self) -> None:
        """Leave the group (peers see their next collective fail)."""
        with contextlib.suppress(RuntimeError, AttributeError):
            self.group.shutdown()
