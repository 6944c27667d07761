"""The one conversion from a request's sampling settings on the wire to the engine's.

``common.wire.tokenizer.WireSamplingParams`` (validated by the gateway, carried by every hop) and
``gpu.sampling_params.SamplingParams`` (what the engine and the sampler read) share their fields by
name. ``sampling_params`` copies every field the engine type has, so a field the wire adds is
carried as soon as the engine type has it too, and cannot be forgotten by a hand-written copy
(one used to drop ``stop_token_ids`` and ``logprobs`` on the speculator's path). The wire's
other fields are the detokenizer's (it applies them to text), listed in
``WireSamplingParams.DETOKENIZER_ONLY``; a field that is in neither type's list fails at import, so
the two types cannot drift apart silently.

Used by the executor (each submitted request) and the speculator (each sequence it drafts for).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from common.wire.tokenizer import WireSamplingParams
from gpu.sampling_params import SamplingParams

# The engine's fields, in its order: exactly what is copied from the wire.
CARRIED: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingParams))


def unmatched_fields() -> tuple[set[str], set[str]]:
    """Wire fields neither carried nor the detokenizer's, and engine fields the wire lacks."""
    wire = {f.name for f in dataclasses.fields(WireSamplingParams)}
    carried = set(CARRIED)
    return wire - carried - WireSamplingParams.DETOKENIZER_ONLY, carried - wire


def _check_fields() -> None:
    dropped, missing = unmatched_fields()
    if dropped or missing:
        raise TypeError(
            "WireSamplingParams and SamplingParams disagree: "
            f"wire fields the engine would drop {sorted(dropped)}, "
            f"engine fields the wire lacks {sorted(missing)}; add the field to both types, or "
            "list a text-only one in WireSamplingParams.DETOKENIZER_ONLY"
        )


_check_fields()  # at import: a service with mismatched types does not start


def _engine_value(value: Any) -> Any:
    # The wire decodes sequences as lists; the engine's type is frozen and hashable (tuples).
    return tuple(_engine_value(v) for v in value) if isinstance(value, list) else value


def sampling_params(wire: WireSamplingParams) -> SamplingParams:
    """The engine's parameters for ``wire`` (raises ``ValueError`` for an out-of-range value,
    naming the field)."""
    return SamplingParams(**{name: _engine_value(getattr(wire, name)) for name in CARRIED})
