"""A model's own sampling defaults (its ``generation_config.json``), applied as vLLM applies them
by default (``--generation-config auto``): a request that leaves one of ``SAMPLING_KEYS`` unset
gets the model's value rather than OpenAI's default. Qwen2.5-Instruct ships temperature 0.7,
top_p 0.8, top_k 20 and repetition_penalty 1.05; Llama 3.1 temperature 0.6 and top_p 0.9.

The gateway says which keys a request left unset (``GenerateRequest.sampling_unset``, it alone
sees the body) and the tokenizer, which has the model's folder, fills them in.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("meshserve.generation_defaults")

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# vLLM only asks repetition_penalty > 0, but the sampler divides a seen token's positive logit
# by it (and every logit by a temperature down to 1e-5): at 1e-40 that overflows fp32 and the
# logprobs are NaN (1e-30 already gives logprobs of -4e31). 0.01 multiplies a seen token's logit
# by at most 100, which already makes the model repeat what it has seen, and keeps logits
# finite (|logit| * 100 * 1e5 stays far below fp32's 3.4e38 for any logit a model produces).
MIN_REPETITION_PENALTY = 0.01
# (low, high, low excluded) of each number a client may send (the gateway's check) and a
# model's generation_config may set; top_k is any integer from -1
SAMPLING_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (MIN_REPETITION_PENALTY, 2.0, False),
}


def _valid(key: str, value: Any) -> bool:
    """In the range a client may send (a value the gateway would refuse is ignored)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    if key == "top_k":
        return isinstance(value, int) and value >= -1
    low, high, low_open = SAMPLING_RANGES[key]
    return (low < value if low_open else low <= value) and value <= high


def sampling_defaults(folder: Path) -> dict[str, Any]:
    """The valid ``SAMPLING_KEYS`` of ``folder/generation_config.json`` ({} without one)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return {}
    out: dict[str, Any] = {}
    for key in SAMPLING_KEYS:
        value = raw.get(key) if isinstance(raw, dict) else None
        if value is None:
            continue
        if not _valid(key, value):
            log.warning("ignoring %s's %s = %r: out of range", path, key, value)
            continue
        out[key] = -1 if key == "top_k" and value == 0 else value  # 0: no top-k, as -1
    return out
