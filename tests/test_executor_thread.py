"""The executor's engine thread: one thread for all torch work, at a lower priority."""

from __future__ import annotations

import glob
import os
import sys
import threading

import pytest
import torch

from services.executor.config import parse_args
from services.executor.service import engine_thread


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux behaviour")
def test_engine_thread_and_its_openmp_threads_are_niced() -> None:
    base = _nice(0)
    worker = engine_thread(5)
    try:

        def run() -> tuple[int, set[int]]:
            x = torch.randn(512, 512)
            (x @ x).sum()  # starts this thread's OpenMP team, if it has one
            return threading.get_native_id(), {
                int(path.rsplit("/", 1)[1]) for path in glob.glob(f"/proc/{os.getpid()}/task/*")
            }

        tid, before_threads = worker.submit(run).result()
        assert _nice(tid) == min(19, base + 5)
        assert _nice(threading.get_native_id()) == base  # the caller keeps its priority
        # Threads the engine thread started (OpenMP's) inherit its niceness.
        started = [t for t in before_threads if t != tid and _nice_or_none(t) == base + 5]
        assert torch.get_num_threads() == 1 or started
    finally:
        worker.shutdown()


def _nice_or_none(tid: int) -> int | None:
    try:
        return _nice(tid)
    except OSError:
        return None


def test_engine_nice_flag_is_validated() -> None:
    assert parse_args(["--model", "x"]).engine_nice == 10
    assert parse_args(["--model", "x", "--engine-nice", "0"]).engine_nice == 0
    with pytest.raises(ValueError, match="engine_nice"):
        parse_args(["--model", "x", "--engine-nice", "25"])
