"""Host <-> device copies (gpu/transfers.py) and the GPU check's sampling section on the CPU;
the no-host-wait check itself runs where CUDA is."""

from __future__ import annotations

import math

import pytest
import torch

from gpu.sampling import Sampler
from gpu.transfers import move, to_device, to_host
from tools.gpu_check import sampler_waits

CPU = torch.device("cpu")


def test_copies_keep_values_and_dtype_on_cpu() -> None:
    ids = to_device([3, 1, 2], torch.int64, CPU)
    assert ids.dtype == torch.int64 and ids.tolist() == [3, 1, 2]
    probs = to_device([0.5, 0.25], torch.float32, CPU)
    host = torch.arange(4)
    assert move(host, CPU) is host  # nothing to copy on the CPU
    a, b = to_host(ids, probs)
    assert a == [3, 1, 2] and b == [0.5, 0.25]
    assert to_host(torch.zeros(2, 2, dtype=torch.int32)) == [[[0, 0], [0, 0]]]


def test_sampler_output_reads_back_every_result_at_once() -> None:
    logits, inp = sampler_waits.mixed_batch(16, 500, CPU, seed=1)
    out = Sampler()(logits, inp)
    host = out.to_host()
    assert host.token_ids == out.token_ids.tolist()
    assert out.top is not None and host.logprobs is not None and host.top_logprobs is not None
    for i, p in enumerate(inp.params):
        if p.logprobs is None:
            assert math.isnan(host.logprobs[i]) and host.top_logprobs[i] == []
        else:
            assert host.logprobs[i] == pytest.approx(float(out.logprobs[i]))  # type: ignore[index]
            assert len(host.top_logprobs[i]) == p.logprobs
    assert sampler_waits.check_rows(logits, inp, host) == []


def test_check_rows_reports_a_wrong_token() -> None:
    logits, inp = sampler_waits.mixed_batch(8, 300, CPU, seed=2)
    host = Sampler()(logits, inp).to_host()
    greedy = next(i for i, p in enumerate(inp.params) if p.is_greedy)
    host.token_ids[greedy] = int(logits[greedy].argmin())
    assert any(
        p.startswith(f"row {greedy}: greedy token")
        for p in sampler_waits.check_rows(logits, inp, host)
    )
    top_k = next(i for i, p in enumerate(inp.params) if p.top_k == 40 and not p.is_greedy)
    host = Sampler()(logits, inp).to_host()
    host.token_ids[top_k] = int(logits[top_k].argmin())
    assert f"row {top_k}: token {host.token_ids[top_k]} is outside the top 40" in (
        sampler_waits.check_rows(logits, inp, host)
    )


def test_sampling_section_on_cpu_says_the_wait_check_needs_cuda() -> None:
    result = sampler_waits.sampling_section(CPU, [1, 8], 400, iters=2)
    assert result["ok"] is True
    assert [r["batch"] for r in result["results"]] == [1, 8]
    assert all(r["host_waits"] == "not checked (needs CUDA)" for r in result["results"])
    assert all(r["ms_per_call"] > 0 and r["problems"] == [] for r in result["results"])
    assert "| batch |" in result["table"]
    verification = result["verification"]  # the drafts verified, their waits counted on CUDA
    assert verification["tokens_ok"] and verification["waits"] is None
    assert "speculative verification: host waits not counted (needs CUDA)" in result["table"]


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the sampler's host waits exist on a GPU only"
)
def test_sampler_does_not_wait_for_the_gpu() -> None:
    device = torch.device("cuda", 0)
    for batch in (1, 8, 64):
        logits, inp = sampler_waits.mixed_batch(batch, 49152, device, seed=batch)
        host, wait = sampler_waits.sample_once(Sampler(), logits, inp)
        assert wait is None, wait
        assert sampler_waits.check_rows(logits, inp, host) == []
