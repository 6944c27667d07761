"""The JSON result document: writing it, and reading it back as a list of runs.

A single run::

    {"schema": "meshserve-loadtest/1", "kind": "run", "label": ...,
     "config": {...}, "summary": {...}, "requests": [{...}, ...]}

A sweep (one run per rate)::

    {"schema": "meshserve-loadtest/1", "kind": "sweep", "config": {...},
     "runs": [{"label": ..., "config": {...}, "summary": {...}, "requests": [...]}, ...]}

``config`` holds the target, workload and load parameters (never the API key); in a sweep
the top-level ``config`` is shared and each run's ``config`` holds its load parameters.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.runner import RunResult
from loadtest.stats import summarize

__all__ = ["SCHEMA", "LoadedRun", "build_document", "load_runs", "run_record", "write_document"]

SCHEMA = "meshserve-loadtest/1"


def run_record(run: RunResult, slo: dict[str, float] | None = None) -> dict[str, Any]:
    """One run as JSON: label, load config, summary and every request."""
    return {
        "label": run.label,
        "started_at": run.started_at,
        "config": run.load.to_json(),
        "summary": summarize(run.results, run.duration_s, slo, run.max_in_flight),
        "requests": [r.to_json() for r in run.results],
    }


def build_document(
    config: dict[str, Any], records: list[dict[str, Any]], sweep: bool
) -> dict[str, Any]:
    """The whole output document from the shared config and the run records."""
    if not sweep:
        if len(records) != 1:
            raise ValueError("a single-run document needs exactly one run")
        rec = records[0]
        return {
            "schema": SCHEMA,
            "kind": "run",
            "label": rec["label"],
            "started_at": rec["started_at"],
            "config": {**config, **rec["config"]},
            "summary": rec["summary"],
            "requests": rec["requests"],
        }
    return {"schema": SCHEMA, "kind": "sweep", "config": config, "runs": records}


def write_document(doc: dict[str, Any], path: str | Path) -> None:
    p = Path(path)
    if p.parent != Path():
        p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(p)


@dataclass
class LoadedRun:
    """One run read back from a result file."""

    source: str
    """The file's name without its suffix."""
    label: str
    config: dict[str, Any]
    """The shared config merged with the run's load config."""
    summary: dict[str, Any]
    requests: list[dict[str, Any]]
    in_sweep: bool

    @property
    def name(self) -> str:
        return f"{self.source} {self.label}".strip()

    @property
    def rate(self) -> float | None:
        """The offered rate (None for a closed-loop run)."""
        r = self.config.get("rate")
        if r == "inf":
            return math.inf
        return float(r) if isinstance(r, int | float) else None

    def values(self, metric: str) -> list[float]:
        """Per-request values of ``ttft_ms``, ``tpot_ms``, ``e2e_ms`` or ``itl_ms`` (flattened),
        completed requests only."""
        out: list[float] = []
        for req in self.requests:
            if not req.get("success"):
                continue
            v = req.get(metric)
            if isinstance(v, list):
                out.extend(float(x) for x in v)
            elif isinstance(v, int | float):
                out.append(float(v))
        return out


def load_runs(path: str | Path) -> list[LoadedRun]:
    """Every run in a result file (one for a single run, one per rate for a sweep)."""
    p = Path(path)
    doc = json.loads(p.read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or ("summary" not in doc and "runs" not in doc):
        raise ValueError(f"{p}: not a loadtest result file")
    source = p.stem
    if "runs" in doc:
        shared = doc.get("config") or {}
        return [
            LoadedRun(
                source,
                str(run.get("label", f"run{i}")),
                {**shared, **(run.get("config") or {})},
                run["summary"],
                run.get("requests") or [],
                True,
            )
            for i, run in enumerate(doc["runs"])
        ]
    return [
        LoadedRun(
            source,
            str(doc.get("label", "")),
            doc.get("config") or {},
            doc["summary"],
            doc.get("requests") or [],
            False,
        )
    ]
