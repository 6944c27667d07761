"""One linear-layer interface; weight formats plug in behind it.

The model only calls ``Linear.forward``; how the weight is stored (fp32/bf16 today, int8 or
fp8 with scales later) is the layer's business, chosen once at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x @ W.T + b`` with a dense floating-point weight ``[out_features, in_features]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
