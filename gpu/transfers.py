"""Host <-> device copies that do not stall the host on the GPU's queue.

On CUDA, ``torch.tensor(values, device="cuda")`` copies from pageable host memory and then
waits for the stream, which holds everything queued before it (the step's forward pass): the
host then builds the sampler's next small tensor only once the model has finished. Staged
through pinned memory with ``non_blocking=True`` the copy is queued behind the forward pass
and the host goes on (torch's caching host allocator keeps the pinned block alive until the
copy has run). Reading results back is the one wait a step needs: :func:`to_host` queues every
tensor's copy and then waits once, instead of once per tensor (or per row, for ``float(t[i])``).
On CPU both are plain conversions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A 1-D tensor of ``values`` on ``device``, its copy queued without a host wait on CUDA."""
    return move(torch.tensor(values, dtype=dtype), device)


def move(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``, its copy queued without a host wait on CUDA."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Tensors' copies to the host, queued now; :meth:`wait` waits for those copies alone (an
    event recorded behind them), not for what the stream runs after them: the overlapped step
    loop queues the next forward pass first and then reads the previous step's tokens."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._values: list[Any] | None = None
        self._events: list[Any] = []
        if not any(t.device.type == "cuda" for t in tensors):
            self._values = [t.tolist() for t in tensors]
            return
        self._staged = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            self._staged.append(host.copy_(t, non_blocking=True))
        self._events = []
        for device in {t.device for t in tensors if t.device.type == "cuda"}:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            self._events.append(event)

    def wait(self) -> list[Any]:
        """Each tensor's values as Python lists (``Tensor.tolist``)."""
        if self._values is None:
            for event in self._events:
                event.synchronize()
            self._values = [h.tolist() for h in self._staged]
        return self._values


def to_host(*tensors: torch.Tensor) -> list[Any]:
    """Each tensor's values as Python lists (``Tensor.tolist``), after one wait for the device."""
    return HostCopy(*tensors).wait()
