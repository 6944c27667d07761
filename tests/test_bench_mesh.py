"""tools.bench.mesh end to end on the tiny model: both sides, both workloads, one table."""

from __future__ import annotations

import itertools
import re

import pytest

from loadtest.client import RequestResult
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


def test_ttft_percentiles_stay_within_the_samples() -> None:
    """statistics.quantiles' default extrapolates past the largest sample under 100 samples
    (63 values 1..63 and one 500 gave a p99 of 653)."""
    side = bench.Side("x", 1.0, 1, [*map(float, range(1, 64)), 500.0], 64)
    assert side.ttft(99) <= 500.0 and side.ttft(50) == 32.5
    assert bench.Side("x", 1.0, 1, [5.0], 1).ttft(99) == 5.0


def test_open_loop_ttft_counts_from_the_scheduled_arrival() -> None:
    """A request sent 0.4 s after its arrival (the client's loop was busy) has waited that
    long too, as the in-process side counts it."""
    late = RequestResult(request_id=0, start_s=1.4, scheduled_s=1.0)
    late.ttft_s = 0.05
    assert abs(bench.ttft_from_arrival(late) - 0.45) < 1e-9
    closed = RequestResult(request_id=1, start_s=3.0)
    closed.ttft_s = 0.05
    assert bench.ttft_from_arrival(closed) == 0.05
