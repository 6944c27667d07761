"""``compare A.json B.json``: two summaries side by side with the ratios B/A."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtest.results import LoadedRun, load_runs
from loadtest.table import SUMMARY_ROWS, fmt, format_table, get

__all__ = ["compare_files", "compare_summaries", "config_differences", "pair_runs", "ratio"]

# What names the server under test rather than the load sent to it: two servers compared on
# one load differ here by design.
SERVER_KEYS = frozenset({"base_url", "url", "model", "api_key_set", "timeout_s"})


def ratio(a: Any, b: Any) -> float | None:
    """b / a for two numbers with a != 0, else None."""
    if isinstance(a, bool) or isinstance(b, bool):
        return None
    if not isinstance(a, int | float) or not isinstance(b, int | float) or a == 0:
        return None
    return float(b) / float(a)


def compare_summaries(
    a: dict[str, Any], b: dict[str, Any], a_name: str = "A", b_name: str = "B"
) -> str:
    """A table: metric | A | B | B/A."""
    rows = []
    for name, path in SUMMARY_ROWS:
        va, vb = get(a, path), get(b, path)
        r = ratio(va, vb)
        rows.append([name, fmt(va), fmt(vb), "-" if r is None else f"{r:.3f}"])
    rows.append(["errors", fmt(a.get("errors") or None), fmt(b.get("errors") or None), ""])
    return format_table(["metric", a_name, b_name, "B/A"], rows)


def config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """``key: A vs B`` for each setting of the load (workload, lengths, rate or concurrency,
    seed, SLOs, ...) that is not the same in both runs: their ratios then compare different
    work, not two servers."""
    keys = sorted((a.keys() | b.keys()) - SERVER_KEYS)
    return [f"{k}: {a.get(k, '-')} vs {b.get(k, '-')}" for k in keys if a.get(k) != b.get(k)]


def pair_runs(a: list[LoadedRun], b: list[LoadedRun]) -> list[tuple[LoadedRun, LoadedRun]]:
    """Runs of A and B to compare: by label when the labels match, else by position."""
    if len(a) == 1 and len(b) == 1:
        return [(a[0], b[0])]
    by_label = {r.label: r for r in b}
    pairs = [(ra, by_label[ra.label]) for ra in a if ra.label in by_label]
    if pairs:
        return pairs
    return list(zip(a, b, strict=False))


def compare_files(a_path: str | Path, b_path: str | Path) -> str:
    """The comparison text for two result files (one table per paired run)."""
    runs_a, runs_b = load_runs(a_path), load_runs(b_path)
    pairs = pair_runs(runs_a, runs_b)
    blocks = [f"A = {a_path}\nB = {b_path}"]
    for ra, rb in pairs:
        title = f"[{ra.label or 'run'}]" if ra.label == rb.label else f"[{ra.label} vs {rb.label}]"
        block = title + "\n" + compare_summaries(ra.summary, rb.summary)
        differences = config_differences(ra.config, rb.config)
        if differences:
            block += "\nnot the same load; these settings differ:\n" + "\n".join(
                f"  {line}" for line in differences
            )
        blocks.append(block)
    if len(pairs) < max(len(runs_a), len(runs_b)):
        blocks.append(f"({len(runs_a)} runs in A, {len(runs_b)} in B: compared {len(pairs)} pairs)")
    return "\n\n".join(blocks)
