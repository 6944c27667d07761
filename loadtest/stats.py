"""Percentiles, SLOs and the summary of a run."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from loadtest.client import RequestResult

__all__ = [
    "LATENCY_METRICS",
    "PERCENTILES",
    "SLO_METRICS",
    "describe",
    "meets_slo",
    "parse_duration_ms",
    "parse_slo",
    "summarize",
]

PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
SLO_METRICS = ("ttft", "tpot", "e2e")

_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "": 1.0}


def describe(values: Iterable[float]) -> dict[str, float | None]:
    """mean, p50, p90, p95, p99 and max of ``values`` (None for all when empty)."""
    arr = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    keys = ["mean", *(f"p{p}" for p in PERCENTILES), "max"]
    if arr.size == 0:
        return dict.fromkeys(keys)
    out: dict[str, float | None] = {"mean": round(float(arr.mean()), 4)}
    for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES), strict=True):
        out[f"p{p}"] = round(float(v), 4)
    out["max"] = round(float(arr.max()), 4)
    return out


def parse_duration_ms(text: str) -> float:
    """``"500ms"``, ``"0.5s"``, ``"800us"`` or a bare number of milliseconds, in ms."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s|)\s*", text)
    if not m:
        raise ValueError(f"bad duration {text!r} (e.g. 500ms, 0.5s)")
    return float(m.group(1)) * _UNITS_MS[m.group(2)]


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft=500ms,tpot=50ms,e2e=10s"`` -> ``{"ttft": 500.0, "tpot": 50.0, "e2e": 10000.0}``."""
    slo: dict[str, float] = {}
    if not text:
        return slo
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower().removesuffix("_ms")
        if not sep or key not in SLO_METRICS:
            raise ValueError(f"bad SLO {part!r}: expected one of {', '.join(SLO_METRICS)}=<time>")
        slo[key] = parse_duration_ms(value)
    return slo


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    """Whether ``r`` completed and met every SLO (in ms); TPOT is met by 1-token answers."""
    if not r.success:
        return False
    if "ttft" in slo and (r.ttft_s is None or r.ttft_s * 1000.0 > slo["ttft"]):
        return False
    tpot = r.tpot_s
    if "tpot" in slo and tpot is not None and tpot * 1000.0 > slo["tpot"]:
        return False
    return not ("e2e" in slo and (r.e2e_s is None or r.e2e_s * 1000.0 > slo["e2e"]))


def _ms(values: Iterable[float | None]) -> list[float]:
    return [v * 1000.0 for v in values if v is not None]


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    slo: dict[str, float] | None = None,
    max_in_flight: int | None = None,
) -> dict[str, Any]:
    """The aggregate view of one run; latencies count completed requests only."""
    slo = slo or {}
    ok = [r for r in results if r.success]
    dur = max(duration_s, 1e-9)
    good = sum(1 for r in ok if meets_slo(r, slo))
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    with_cache = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cache_queries = sum(r.prompt_tokens or 0 for r in with_cache)
    cached_tokens = sum(r.cached_tokens or 0 for r in with_cache)
    errors = Counter(r.error_kind or "unknown" for r in results if not r.success)
    return {
        "total": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(sorted(errors.items())),
        "duration_s": round(duration_s, 4),
        "request_throughput": round(len(ok) / dur, 4),
        "output_token_throughput": round(out_tokens / dur, 4),
        "input_token_throughput": round(in_tokens / dur, 4),
        "goodput": round(good / dur, 4),
        "slo": dict(slo),
        "slo_attainment": round(good / len(results), 4) if results else None,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "usage_reported": sum(1 for r in ok if r.usage_reported),
        "total_cached_tokens": cached_tokens,
        # Prompt tokens the server reported as served from its prefix cache, over the prompt
        # tokens of the requests that report it (None when the server reports none).
        "prefix_cache_hit_rate": round(cached_tokens / cache_queries, 4) if with_cache else None,
        "max_in_flight": max_in_flight,
        "ttft_ms": describe(_ms(r.ttft_s for r in ok)),
        "tpot_ms": describe(_ms(r.tpot_s for r in ok)),
        "itl_ms": describe(_ms(x for r in ok for x in r.itl_s)),
        "e2e_ms": describe(_ms(r.e2e_s for r in ok)),
    }
