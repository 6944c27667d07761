"""Child processes that end with the process that started them (Linux).

``meshserve up`` starts a nats-server and every service; killed with SIGKILL (or by the OOM
killer) it cannot stop them, and they would go on holding the HTTP port, the NATS port and
the GPUs, so the next ``up`` fails. ``PR_SET_PDEATHSIG`` has the kernel signal a child when
the thread that started it exits. It is set between fork and exec (``preexec_fn``) and kept
across exec; where there is no ``prctl`` (not Linux) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def end_with_parent(parent_pid: int, sig: int) -> None:
    """In the child: ``sig`` to this process when its parent (``parent_pid``) dies; exit at
    once if it has died already (before ``prctl`` took effect)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def ends_with_this_process(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process
    (the thread that calls Popen: start children from one that lives as long) dies."""
    return functools.partial(end_with_parent, os.getpid(), sig)
