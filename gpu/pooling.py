"""Embeddings (``/v1/embeddings``): a prompt's final hidden states pooled into one vector.

The prefill chunks of an embedding sequence ask the forward pass for the hidden states of the
prompt positions its pooling takes (``HiddenTap``: after the model's final norm, what
transformers' base model returns, before the LM head). ``PromptPooling`` keeps their fp32 sum
or the one row on the device, across chunks, and with the prompt's last chunk cuts the vector
to the requested size (Matryoshka), L2-normalizes it when asked, and queues its copy to the
host; it is read with the request's first (and only) token. Mean and CLS pooling need every
position computed, so such a sequence gets no prefix-cache hit (as a scoring one); last-token
pooling takes any, since the last prompt position is always computed. A sequence preempted
midway is recomputed from its first token, and positions already pooled are not pooled again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gpu.pooler_config import POOLING_TYPES
from gpu.transfers import HostCopy, move


@dataclass
class HiddenTap:
    """The rows of a step (flat token indices) whose final hidden states the forward pass
    hands back beside the logits: ``rows[i]`` is row ``indices[i]``'s, after the final norm,
    in the model's dtype (set by ``CausalLM.forward``); ``parts``: which sequence pools which
    of them (its positions, and its prompt's length), in row order."""

    index_list: list[int] = field(default_factory=list)
    parts: list[tuple[PromptPooling, range, int]] = field(default_factory=list)
    rows: torch.Tensor | None = None
    _indices: torch.Tensor | None = None

    @property
    def indices(self) -> torch.Tensor:
        if self._indices is None:
            self._indices = torch.tensor(self.index_list, dtype=torch.int64)
        return self._indices

    def to(self, device: torch.device) -> None:
        """The indices on the step's device (without a host wait)."""
        self._indices = move(self.indices, device)

    def add(
        self, pooling: PromptPooling, flat: int, start: int, num_new: int, prompt_len: int
    ) -> None:
        """A sequence's chunk ``[start, start + num_new)``, its first row ``flat`` of the
        step: the rows of the positions it pools."""
        positions = pooling.positions(start, num_new, prompt_len)
        if positions:
            self.index_list += [flat + p - start for p in positions]
            self.parts.append((pooling, positions, prompt_len))

    def hand_out(self) -> None:
        """Each sequence its rows (before its ``num_computed`` moves past the chunk)."""
        assert self.rows is not None, "the forward pass filled no tap"
        row = 0
        for pooling, positions, prompt_len in self.parts:
            pooling.take(self.rows[row : row + len(positions)], positions, prompt_len)
            row += len(positions)


@dataclass
class PromptPooling:
    """An embedding sequence's vector in the making (``Sequence.pooling``)."""

    mode: str
    dimensions: int | None = None
    normalize: bool = True
    taken: int = 0  # prompt positions pooled, from the first
    total: torch.Tensor | None = None  # the fp32 sum (mean) or the row (last, cls)
    result: HostCopy | None = None

    def __post_init__(self) -> None:
        if self.mode not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}: {self.mode!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"pooling_dimensions must be >= 1, got {self.dimensions}")

    @property
    def every_position(self) -> bool:
        """Whether every prompt position must be computed here (no prefix-cache hit)."""
        return self.mode != "last"

    def positions(self, start: int, num_new: int, prompt_len: int) -> range:
        """The prompt positions of the chunk ``[start, start + num_new)`` to pool."""
        end = min(start + num_new, prompt_len)
        if self.mode == "last":
            last = prompt_len - 1
            return range(last, last + 1) if start <= last < end else range(0)
        if self.mode == "cls":
            return range(0, 1) if start == 0 < end and self.taken == 0 else range(0)
        return range(max(start, self.taken), end)

    def take(self, rows: torch.Tensor, positions: range, prompt_len: int) -> None:
        """Pool ``rows`` (the final hidden states of ``positions``, in order); with the
        prompt's end, finish the vector and queue its copy to the host."""
        if not positions:
            return
        rows = rows.float()
        if self.mode == "mean":
            part = rows.sum(dim=0)
            self.total = part if self.total is None else self.total + part
        else:
            self.total = rows[-1]
        self.taken = positions.stop
        if self.mode == "cls" or self.taken >= prompt_len:
            self.result = HostCopy(self._finish(prompt_len))

    def _finish(self, prompt_len: int) -> torch.Tensor:
        assert self.total is not None
        vector = self.total / prompt_len if self.mode == "mean" else self.total
        if self.dimensions is not None:
            vector = vector[: self.dimensions]
        if self.normalize:
            vector = F.normalize(vector, p=2.0, dim=0)
        return vector

    def vector(self) -> list[float] | None:
        """The embedding, once the prompt's last chunk has run (one wait: it was queued when
        that chunk ran)."""
        if self.result is None:
            return None
        values: list[float] = self.result.wait()[0]
        return values
