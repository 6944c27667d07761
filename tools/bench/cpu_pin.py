"""Each region of the regions bench on cores of its own (``--pin-regions``).

Two regions on one machine share its cores: the overloaded region's Python work (and, with
spillover, the guests' in the other region) slows every process of both, which regions on
separate hosts would not see. Pinned, each region's processes (its services, spawned by its
child process, and its NATS servers) run on their own cores; the load generator and the
delaying proxy stay free to run anywhere, as clients and a network would.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path


def region_cpus(index: int, regions: int) -> set[int]:
    """The cores of region ``index``: an equal share of this process's cores, in order."""
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // regions)
    start = (index * share) % len(cores)
    return set(cores[start : start + share])


def pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that puts a child (and what it starts later) on ``cpus``."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of a running process onto ``cpus`` (a Go server has started its threads:
    the affinity of a process's id is its first thread's only)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cpus)
