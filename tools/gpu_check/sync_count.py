"""Host waits counted around a piece of the step: torch's sync debug mode set to "warn" makes
the operations torch itself makes wait for a CUDA stream (``.item()``, ``.tolist()``, a
boolean-mask index, a blocking copy) warn; the warnings are recorded and returned. It does not
see every wait: an event's (``gpu.transfers.HostCopy``, the one read-back a step needs, on
purpose), ``torch.cuda.synchronize()``, a "non-blocking" copy from pageable memory (the driver
makes it wait) or a wait inside another library's extension. So the count is a lower bound;
an overlapped step's should be 0. On the CPU nothing is counted."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def count_syncs(fn: Callable[[], T], device: torch.device) -> tuple[T, list[str] | None]:
    """``fn()`` and the host waits it made (their warnings' first lines); None off CUDA."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    waits = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    return result, waits
