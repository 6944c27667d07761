"""tools.bench.mesh end to end on the tiny model: both sides, both workloads, one table."""

from __future__ import annotations

import itertools
import re

import pytest

from tools.bench import mesh as bench


def test_poisson_arrivals_are_seeded_and_increasing() -> None:
    a = bench.poisson_arrivals(50, 4.0, seed=1)
    assert a == bench.poisson_arrivals(50, 4.0, seed=1)
    assert a != bench.poisson_arrivals(50, 4.0, seed=2)
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    assert 50 / 4.0 * 0.5 < a[-1] < 50 / 4.0 * 1.5  # mean gap 1/rate


def test_bench_runs_both_sides_and_reports(tiny_llama, capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(
        ["--model", str(tiny_llama), "--rounds", "1", "--requests", "6", "--concurrency", "3",
         "--output-tokens", "5", "--port", "8141"]
    )  # fmt: skip
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| closed") or
            line.startswith("| open")]  # fmt: skip
    assert len(rows) == 8  # 2 workloads x (1 round + median) x 2 sides
    for row in rows:
        tokens_per_s = float(row.split("|")[5])
        assert tokens_per_s > 0
    assert re.search(r"mesh throughput / in-process \(median rounds\): \d+\.\d%", out)
    assert re.search(r"TTFT added by the mesh \(median over rounds\): p50 [+-]\d", out)
