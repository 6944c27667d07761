"""Host waits counted around a piece of the step: torch's sync debug mode set to "warn" makes
every operation that waits for a CUDA stream (``.item()``, ``.tolist()``, a pageable copy, a
boolean-mask index, a stream synchronize) warn; the warnings are recorded and returned. Waiting
on an event (``gpu.transfers.HostCopy``: the one read-back a step needs) does not warn, so an
overlapped step's count should be 0. On the CPU nothing is counted."""

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
