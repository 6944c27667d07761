"""The regions bench's ``--pin-regions`` (``tools/bench/cpu_pin.py``): each region's cores."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tools.bench.cpu_pin import pin_process, pinned, region_cpus

CORES = sorted(os.sched_getaffinity(0))


def test_regions_get_equal_shares_of_the_cores_in_order():
    shares = [region_cpus(i, 2) for i in range(2)]
    if len(CORES) >= 2:
        assert not shares[0] & shares[1]
        assert len(shares[0]) == len(shares[1]) == len(CORES) // 2
    assert all(s and s <= set(CORES) for s in shares)
    assert region_cpus(0, len(CORES) + 1) == {CORES[0]}  # more regions than cores: one each


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to tell a pinned process apart")
def test_a_child_and_a_running_process_with_its_threads_are_pinned():
    one = {CORES[-1]}
    child = subprocess.Popen(["sleep", "30"], preexec_fn=pinned(one))
    # A process with threads already running: the pin must reach each of them.
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start()"
    threaded = subprocess.Popen(["python3", "-c", code + "; time.sleep(30)"])
    try:
        assert os.sched_getaffinity(child.pid) == one
        deadline = time.monotonic() + 20
        while len(os.listdir(f"/proc/{threaded.pid}/task")) < 2:
            assert time.monotonic() < deadline, "the thread never started"
            time.sleep(0.05)
        pin_process(threaded.pid, one)
        tasks = [int(t) for t in os.listdir(f"/proc/{threaded.pid}/task")]
        assert len(tasks) == 2
        assert all(os.sched_getaffinity(t) == one for t in tasks)
    finally:
        for proc in (child, threaded):
            proc.kill()
            proc.wait()
    assert pinned(None) is None
