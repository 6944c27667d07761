"""``python -m gpu.parallel.worker SPEC RANK``: one tensor-parallel rank other than 0.

It joins the group, loads its shard of the model and a KV pool (``RankSpec``), says it is
ready, then runs every step rank 0 broadcasts until rank 0 says stop or goes away. It has no
NATS and no engine: rank 0's engine schedules for the group, and page ids mean the same
pages in every rank's pool.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import torch

from common.parent_death import end_with_parent
from gpu.linear import warm_triton_linears
from gpu.loader import load_model
from gpu.parallel.group import ParallelGroupLost, TensorParallel
from gpu.parallel.launch import RankSpec
from gpu.parallel.shard import Shard
from gpu.parallel.step import unpack_step
from gpu.quant import kv_cache_dtype
from gpu.runner import ModelRunner

log = logging.getLogger("meshserve.tp")


def read_exactly(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return b""  # rank 0 is gone
        data += chunk
    return data


def die_with_parent() -> None:
    """SIGKILL this process when rank 0 dies, even while it loads the model: a restarted
    executor must not find the old ranks still holding memory."""
    end_with_parent(int(os.environ.get("MESHSERVE_TP_PARENT", os.getppid())), signal.SIGKILL)


def serve(spec: RankSpec, rank: int, ready_fd: int) -> None:
    torch.set_num_threads(spec.threads)
    device = spec.device_of(rank)
    tp = TensorParallel.connect(
        Shard(rank, spec.world), spec.port, device, spec.timeout_s, shm_path=spec.shm_path
    )
    model = load_model(
        spec.model, device, progress=False, quantization=spec.quantization,
        cpu_kernels=spec.cpu_kernels, tp=tp,
    )  # fmt: skip
    runner = ModelRunner(
        model,
        spec.num_pages,
        spec.page_size,
        kv_dtype=kv_cache_dtype(spec.kv_cache_dtype, model.dtype),
    )
    # Rank 0's warm-up builds its own Triton matmuls; each rank builds its own before it says
    # it is ready (built inside a step, they would hold every rank at the next all-reduce).
    warm_triton_linears(model.modules(), spec.warm_rows, model.dtype)
    os.write(ready_fd, b"R")
    os.close(ready_fd)
    try:
        run_steps(tp, runner, spec.page_size, device)
    finally:
        tp.close()


def run_steps(
    tp: TensorParallel, runner: ModelRunner, page_size: int, device: torch.device
) -> None:
    control = sys.stdin.fileno()
    while True:
        head = read_exactly(control, 8)
        n = int.from_bytes(head, "little") if head else 0
        if n == 0:
            return
        buf = torch.empty(n, dtype=torch.int64, device=device)
        tp.broadcast_(buf)
        input_ids, meta, all_logits, indices = unpack_step(buf.cpu(), page_size)
        runner.forward(input_ids, meta, all_logits, indices)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    die_with_parent()
    # Rank 0 decides when this rank stops (a zero length, or its end): Ctrl-C or a SIGTERM
    # sent to the whole process group must not end a rank under a step rank 0 still runs.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The ready byte goes on the pipe rank 0 reads; anything a library prints goes to stderr
    # (a pipe nobody reads would fill and block this rank mid-step).
    ready_fd = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    spec, rank = RankSpec.from_json(argv[1]), int(argv[2])
    try:
        serve(spec, rank, ready_fd)
    except ParallelGroupLost as exc:
        log.error("tensor-parallel rank %d: %s", rank, exc)
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destroying a Gloo group whose peer left can abort().
    os._exit(code)
