"""Pieces every section of the GPU check shares: the page size, the relative error measures,
a device synchronize, the markdown tables, the integer-list argument values and ``Report``,
which collects the sections' results into the JSON."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

PAGE_SIZE = 16


def rel_max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in fp32 (inf when ``out`` has a NaN or inf)."""
    out, ref = out.float(), ref.float()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    scale = float(ref.abs().max().item())
    return float((out - ref).abs().max().item()) / (scale if scale > 0 else 1.0)


def rel_l2_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    norm = float(ref.norm().item())
    return float((out - ref).norm().item()) / (norm if norm > 0 else 1.0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, bool):
            return "yes" if value else "NO"
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class Report:
    """Collects section results and rewrites the JSON after each one (a run killed at its
    time limit still leaves what it finished). ``elapsed_s``: seconds from the start to each
    section's last write, to plan the next run within the device's time limit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"sections": {}, "errors": [], "elapsed_s": {}}
        self.started = time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.flush()

    def section(self, name: str, value: dict[str, Any]) -> None:
        self.data["sections"][name] = value
        self.data["elapsed_s"][name] = round(time.monotonic() - self.started, 1)
        self.flush()
        if "table" in value:
            print(f"\n### {name}\n\n{value['table']}\n", flush=True)

    def error(self, name: str, exc: BaseException) -> None:
        traceback.print_exc()
        self.data["sections"][name] = {"ok": False, "error": repr(exc)}
        self.data["elapsed_s"][name] = round(time.monotonic() - self.started, 1)
        self.data["errors"].append(f"{name}: {exc!r}")
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]
