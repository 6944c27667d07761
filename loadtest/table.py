"""Plain-text tables of run summaries (for the terminal and for ``compare``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loadtest.stats import LATENCY_METRICS

__all__ = ["SUMMARY_ROWS", "fmt", "format_table", "get", "summary_table"]

_STAT_NAMES = ("mean", "p50", "p90", "p95", "p99")
_METRIC_NAMES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "E2E"}

SUMMARY_ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("requests completed", ("completed",)),
    ("requests failed", ("failed",)),
    ("duration (s)", ("duration_s",)),
    ("request throughput (req/s)", ("request_throughput",)),
    ("output throughput (tok/s)", ("output_token_throughput",)),
    ("input throughput (tok/s)", ("input_token_throughput",)),
    ("prefix cache hit rate", ("prefix_cache_hit_rate",)),
    ("goodput (req/s)", ("goodput",)),
    ("max in flight", ("max_in_flight",)),
    ("requests with usage (exact token counts)", ("usage_reported",)),
] + [(f"{_METRIC_NAMES[m]} {s} (ms)", (m, s)) for m in LATENCY_METRICS for s in _STAT_NAMES]
"""(row name, key path into a summary) for every number a summary table shows."""


def get(summary: dict[str, Any], path: tuple[str, ...]) -> Any:
    """``summary[path[0]][path[1]]...`` or None."""
    cur: Any = summary
    for key in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(key)
    return cur


def fmt(value: Any) -> str:
    """A compact rendering of a summary value."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        a = abs(value)
        if a >= 1000:
            return f"{value:,.0f}"
        if a >= 100:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned others, a rule under the header."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [cells[0].ljust(widths[0])]
        parts += [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def summary_table(columns: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One column per (label, summary), one row per metric, plus errors and SLOs."""
    headers = ["metric", *(label for label, _ in columns)]
    rows = [[name, *(fmt(get(s, path)) for _, s in columns)] for name, path in SUMMARY_ROWS]
    rows.append(["errors", *(fmt(s.get("errors") or None) for _, s in columns)])
    if any(s.get("slo") for _, s in columns):
        rows.append(["SLO (ms)", *(fmt(s.get("slo") or None) for _, s in columns)])
    return format_table(headers, rows)
