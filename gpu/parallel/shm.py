"""The ranks of one host sum their partial results through shared memory (``shm.c``).

Gloo over loopback TCP costs ~0.5 ms per all-reduce on this machine; a decode step makes 61
of them (two per layer and the embedding), more than the step's own compute. The ranks of a
replica started by ``gpu.parallel.launch`` share a host, so rank 0 creates one mapping (a
file in /dev/shm, removed once every rank has it open) and each rank's all-reduce of a CPU
fp32 tensor goes through it (vLLM's CPU backend does the same); Gloo still carries the step
broadcast, the logits gather and everything else. Layout and protocol: ``shm.c``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import uuid
from pathlib import Path

import torch

from gpu.cpu_kernels import CpuKernels

CAPACITY = 1 << 18  # floats per slot (1 MB): a larger all-reduce goes in several rounds
FLAG_STRIDE = 8  # int64s per flag (shm.c)


def mapping_size(world: int, capacity: int = CAPACITY) -> int:
    header = world * FLAG_STRIDE + (world + 7) // 8 * 8  # int64s: flags, then pids
    return header * 8 + 2 * world * capacity * 4


def create(world: int, capacity: int = CAPACITY) -> str:
    """A zeroed mapping file for ``world`` ranks; its path goes to every rank. Files left by
    a rank 0 that died before its ranks all opened theirs (named by its pid) go first."""
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    for old in folder.glob("meshserve-tp-*-*"):
        pid = old.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                old.unlink()
    path = folder / f"meshserve-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, mapping_size(world, capacity))
    finally:
        os.close(fd)
    return str(path)


class ShmAllReduce:
    """One rank's view of the mapping."""

    def __init__(
        self,
        kernels: CpuKernels,
        path: str,
        rank: int,
        world: int,
        timeout_s: float,
        capacity: int = CAPACITY,
    ) -> None:
        size = mapping_size(world, capacity)
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"{path} is not a mapping for {world} ranks")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # keeps the address
        base = self._bytes.data_ptr()
        words = torch.frombuffer(self._map, dtype=torch.int64, count=world * FLAG_STRIDE + world)
        words[world * FLAG_STRIDE + rank] = os.getpid()  # peers watch it while they wait
        self.kernels = kernels
        self.ctx = torch.tensor(
            [base, rank, world, capacity, 0, int(timeout_s * 1e9), 0, 0, 0, 0], dtype=torch.int64
        )

    @property
    def time_ns(self) -> int:
        """Time spent in all-reduces so far (waits for the other ranks included)."""
        return int(self.ctx[7])

    @property
    def calls(self) -> int:
        return int(self.ctx[8])

    @property
    def lost_rank(self) -> int | None:
        """The rank a call gave up waiting for (it died, or passed the timeout)."""
        failed = int(self.ctx[6])
        return failed - 1 if failed else None

    def all_reduce_(self, tensor: torch.Tensor) -> bool:
        """Sum a contiguous CPU fp32 tensor over the ranks in place; False if a rank is lost."""
        rc = self.kernels.shm_allreduce(self.ctx, tensor)
        return rc == 0

    def hook(self) -> tuple[int, int]:
        """(C function, context) for the fused decode step to call directly."""
        return self.kernels.shm_allreduce_address(), self.ctx.data_ptr()
