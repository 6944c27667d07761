"""``report FILE.json... --out DIR``: PNG plots (matplotlib, Agg) and an ``index.html``.

Plots: the CDFs of TTFT, TPOT, inter-token latency and end-to-end latency with one line per
run of every file; for sweeps, TTFT and TPOT p50/p99 and the achieved throughput against the
offered rate.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.results import LoadedRun, load_runs
from loadtest.table import SUMMARY_ROWS, fmt, get

__all__ = ["write_report"]

_CDF_METRICS = (
    ("ttft_ms", "TTFT"),
    ("tpot_ms", "TPOT"),
    ("itl_ms", "Inter-token latency"),
    ("e2e_ms", "End-to-end latency"),
)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "loadtest report draws with matplotlib: pip install 'meshserve[report]'"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf_plot(plt: Any, runs: Sequence[LoadedRun], metric: str, title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    plotted = 0
    for run in runs:
        vals = np.sort(np.asarray(run.values(metric), dtype=float))
        if vals.size == 0:
            continue
        frac = np.arange(1, vals.size + 1) / vals.size
        ax.step(np.r_[vals[0], vals], np.r_[0.0, frac], where="post", label=run.name)
        plotted += 1
    if plotted == 0:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=7, loc="lower right")
    ax.set_xlabel(f"{title} (ms)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{title} CDF")
    ax.grid(True, alpha=0.3)
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.12, top=0.92)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sweep_points(runs: Sequence[LoadedRun]) -> list[LoadedRun]:
    """The runs of a sweep that have a finite offered rate, by rate."""
    pts = [r for r in runs if r.in_sweep and r.rate is not None and math.isfinite(r.rate)]
    return sorted(pts, key=lambda r: r.rate or 0.0)


def _vs_rate_plot(
    plt: Any,
    sweeps: Sequence[tuple[str, list[LoadedRun]]],
    series: Sequence[tuple[tuple[str, ...], str, str]],
    ylabel: str,
    title: str,
    path: Path,
    diagonal: bool = False,
) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    if diagonal:  # what a server that keeps up would achieve
        top = max(r.rate or 0.0 for _, pts in sweeps for r in pts)
        ax.plot([0, top], [0, top], ":", color="0.6", label="offered rate")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (source, pts) in enumerate(sweeps):
        x = [r.rate for r in pts]
        for key, name, style in series:
            y = [get(r.summary, key) for r in pts]
            y = [float("nan") if v is None else float(v) for v in y]
            ax.plot(x, y, style, color=colors[i % len(colors)], label=f"{source} {name}")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.12, top=0.92)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _summary_html(source: str, runs: Sequence[LoadedRun]) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(r.label or 'run')}</th>" for r in runs)
    body = []
    for name, path in SUMMARY_ROWS:
        cells = "".join(f"<td>{esc(fmt(get(r.summary, path)))}</td>" for r in runs)
        body.append(f"<tr><th>{esc(name)}</th>{cells}</tr>")
    cells = "".join(f"<td>{esc(fmt(r.summary.get('errors') or None))}</td>" for r in runs)
    body.append(f"<tr><th>errors</th>{cells}</tr>")
    if any(r.summary.get("slo") for r in runs):
        cells = "".join(f"<td>{esc(fmt(r.summary.get('slo') or None))}</td>" for r in runs)
        body.append(f"<tr><th>SLO (ms)</th>{cells}</tr>")
    cfg = runs[0].config if runs else {}
    keys = ("base_url", "model", "endpoint", "workload", "mode", "num_requests", "duration_s")
    cfg_text = ", ".join(f"{k}={cfg[k]}" for k in keys if k in cfg)
    return (
        f"<h2>{esc(source)}</h2>\n<p class='cfg'>{esc(cfg_text)}</p>\n"
        f"<table><tr><th>metric</th>{head}</tr>\n" + "\n".join(body) + "</table>\n"
    )


_CSS = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; }
td { text-align: right; font-variant-numeric: tabular-nums; }
tr > th:first-child { text-align: left; font-weight: normal; }
.cfg { color: #666; font-size: 0.85em; }
img { max-width: 100%; margin: 0.5em 0; }
"""


def write_report(paths: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Write the plots and ``index.html`` to ``out_dir``; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [(Path(p).stem, load_runs(p)) for p in paths]
    all_runs = [r for _, runs in files for r in runs]
    plt = _pyplot()
    written: list[Path] = []
    images: list[tuple[str, str]] = []

    for metric, title in _CDF_METRICS:
        path = out / f"cdf_{metric.removesuffix('_ms')}.png"
        _cdf_plot(plt, all_runs, metric, title, path)
        written.append(path)
        images.append((path.name, f"{title} CDF"))

    sweeps = [(src, pts) for src, runs in files if len(pts := _sweep_points(runs)) >= 1]
    if sweeps:
        for metric, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
            path = out / f"{metric.removesuffix('_ms')}_vs_rate.png"
            series: list[tuple[tuple[str, ...], str, str]] = [
                ((metric, "p50"), "p50", "o-"),
                ((metric, "p99"), "p99", "s--"),
            ]
            _vs_rate_plot(plt, sweeps, series, f"{title} (ms)", f"{title} against rate", path)
            written.append(path)
            images.append((path.name, f"{title} p50/p99 against rate"))
        path = out / "throughput_vs_rate.png"
        series = [
            (("request_throughput",), "completed req/s", "o-"),
            (("goodput",), "goodput req/s", "s--"),
        ]
        _vs_rate_plot(
            plt, sweeps, series, "requests/s", "Throughput against rate", path, diagonal=True
        )
        written.append(path)
        images.append((path.name, "Throughput against rate"))

    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    parts = [
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>Load test report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>Load test report</h1>",
        f"<p class='cfg'>{html.escape(', '.join(str(p) for p in paths))} — generated {stamp}</p>",
    ]
    parts += [_summary_html(src, runs) for src, runs in files]
    parts.append("<h2>Plots</h2>")
    parts += [
        f"<figure><img src='{html.escape(name)}' alt='{html.escape(alt)}'>"
        f"<figcaption>{html.escape(alt)}</figcaption></figure>"
        for name, alt in images
    ]
    parts.append("</body></html>\n")
    index = out / "index.html"
    index.write_text("\n".join(parts), encoding="utf-8")
    written.append(index)
    return written
