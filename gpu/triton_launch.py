"""Launching the runtime's Triton kernels on the device their tensors are on.

Triton launches on the current CUDA device's context and stream, not on its arguments' device:
a replica on ``cuda:1`` (``--device cuda:1``) would run its kernels in device 0's context with
pointers into device 1's memory, unordered with device 1's stream. torch's and FlashInfer's
kernels guard on their tensors' device; the Triton launches (``gpu/triton_gemv.py``,
``gpu/triton_quant.py``, ``gpu/attention/rope_append.py``) do so with ``on_device``.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch


class _OnADevice(Protocol):
    @property
    def device(self) -> torch.device: ...


def interpreted() -> bool:
    """Whether Triton runs under its interpreter (``TRITON_INTERPRET=1``: the CPU tests), where
    the kernels take one fixed block configuration instead of tuning."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def on_device(tensor: _OnADevice) -> AbstractContextManager[Any]:
    """``torch.cuda.device(tensor.device)`` for a CUDA tensor (its device current inside);
    nothing to switch elsewhere (CPU tensors under Triton's interpreter)."""
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return nullcontext()
