"""The load generator against a real meshserve (tiny model): counts come from the server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.mesh import MeshHarness


@pytest.fixture(scope="module")
def mesh(tiny_llama):
    harness = MeshHarness(tiny_llama).start()
    yield harness
    harness.stop()


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_loadtest_measures_a_real_mesh(mesh, tmp_path, endpoint):
    out = tmp_path / "run.json"
    cmd = [
        sys.executable, "-m", "loadtest", "run", "--base-url", mesh.base_url, "--model", "tiny",
        "--endpoint", endpoint, "--concurrency", "4", "--num-requests", "12",
        "--input-len", "16", "--output-len", "8", "--ignore-eos", "--no-progress",
        "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["usage_reported"] == 12
    assert summary["total_output_tokens"] == 12 * 8  # ignore_eos: exactly max_tokens each
    assert all(r["output_tokens"] == 8 and r["prompt_tokens"] > 0 for r in result["requests"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        assert 0 < stats["p50"] <= stats["p99"]
    assert summary["ttft_ms"]["p50"] < summary["e2e_ms"]["p50"]
    assert summary["max_in_flight"] <= 4
