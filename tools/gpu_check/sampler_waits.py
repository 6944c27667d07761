"""The GPU check's ``sampling`` section: a mixed batch sampled with no host wait inside the
sampler, its results read back with one.

The batch mixes every path a serving step takes (greedy, temperature, top-k, top-p, min-p,
penalties, logit bias, allowed tokens, bad words, seeded rows, logprobs with top-N). On CUDA
the sampler runs under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any
operation that waits for the device (``.item()``, ``.tolist()``, a boolean-mask index, a
blocking copy), so the section reports the first such operation or none. The results are then
checked against the CPU: greedy rows equal the argmax, every sampled token is one its row's
filters keep, and the logprobs equal a float64 log-softmax of the same logits. On the CPU the
same rows are checked and timed; ``host_waits`` says the wait check needs CUDA.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from gpu.sampling import SampledOnHost, Sampler, SamplerInput
from gpu.sampling_params import SamplingParams, make_generator
from tools.gpu_check.common import markdown_table

ROW_KINDS: tuple[SamplingParams, ...] = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, logprobs=5),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7),
    SamplingParams(temperature=1.0, top_k=40),
    SamplingParams(temperature=0.7, min_p=0.05, logprobs=0),
    SamplingParams(temperature=1.0, top_p=0.95, top_k=200, repetition_penalty=1.2),
    SamplingParams(temperature=0.9, frequency_penalty=0.5, presence_penalty=0.3, logprobs=3),
    SamplingParams(temperature=1.0, logit_bias=((3, 5.0), (11, -100.0))),
    SamplingParams(temperature=0.9, allowed_token_ids=(1, 5, 9, 200), logprobs=2),
    SamplingParams(temperature=0.0, bad_words_token_ids=((7,), (4, 2))),
)


def mixed_batch(
    batch: int, vocab: int, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, SamplerInput]:
    """``batch`` rows of random logits on ``device``, cycling through :data:`ROW_KINDS`, with
    prompt and output histories for the penalties."""
    rng = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=rng) * 3.0).to(device)
    params = [ROW_KINDS[i % len(ROW_KINDS)] for i in range(batch)]
    prompts = [torch.randint(0, vocab, (32,), generator=rng).tolist() for _ in range(batch)]
    outputs = [torch.randint(0, vocab, (8,), generator=rng).tolist() for _ in range(batch)]
    generators = [make_generator(p, device) for p in params]
    return logits, SamplerInput(params, prompts, outputs, generators)


def sample_once(
    sampler: Sampler, logits: torch.Tensor, inp: SamplerInput
) -> tuple[SampledOnHost, str | None]:
    """One sampler call and its read-back: ``(results, the first host wait inside the call)``,
    the wait None when there was none (on CUDA; on the CPU it is not checked)."""
    wait: str | None = None
    if logits.device.type == "cuda":
        torch.cuda.synchronize(logits.device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = sampler(logits, inp)
        except RuntimeError as err:  # the debug mode's report of a synchronizing operation
            wait = str(err).splitlines()[0]
            torch.cuda.set_sync_debug_mode(0)
            out = sampler(logits, inp)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    else:
        out = sampler(logits, inp)
    return out.to_host(), wait


def check_rows(logits: torch.Tensor, inp: SamplerInput, host: SampledOnHost) -> list[str]:
    """What is wrong with ``host`` as the sampling of ``logits`` (an empty list: nothing)."""
    problems: list[str] = []
    reference, on_cpu = Sampler(), _on_cpu(inp)  # (logprobs in its default mode, as sampled)
    ref = reference._processed(logits.cpu().float(), on_cpu, copy=True).double()
    source = reference.logprob_logits(logits.cpu().float(), on_cpu, ref)
    ref_lp = torch.log_softmax(source.double(), dim=-1)
    for i, p in enumerate(inp.params):
        token = host.token_ids[i]
        if p.is_greedy and token != int(ref[i].argmax()):
            problems.append(f"row {i}: greedy token {token}, argmax {int(ref[i].argmax())}")
        if ref[i, token] == -math.inf:
            problems.append(f"row {i}: token {token} is banned (allowed_token_ids, bad_words)")
        if p.top_k > 0 and int((ref[i] > ref[i, token]).sum()) >= p.top_k:
            problems.append(f"row {i}: token {token} is outside the top {p.top_k}")
        if p.logprobs is None:
            continue
        assert host.logprobs is not None and host.top_logprobs is not None
        want = float(ref_lp[i, token])
        if abs(host.logprobs[i] - want) > 1e-3 * max(1.0, abs(want)):
            problems.append(f"row {i}: logprob {host.logprobs[i]:.5f}, reference {want:.5f}")
        top_ids = ref_lp[i].topk(p.logprobs).indices.tolist() if p.logprobs else []
        if [t for t, _ in host.top_logprobs[i]] != top_ids:
            problems.append(f"row {i}: top-{p.logprobs} ids differ from the reference")
    return problems


def _on_cpu(inp: SamplerInput) -> SamplerInput:
    return SamplerInput(
        inp.params, inp.prompt_token_ids, inp.output_token_ids, [None] * len(inp.params)
    )


def sampling_section(
    device: torch.device, batches: list[int], vocab: int, iters: int
) -> dict[str, Any]:
    """Per batch size: the host waits found inside the sampler, the rows' check, and the time
    of one call plus its read-back (mean of ``iters``, after one warm call)."""
    results = []
    for batch in batches:
        logits, inp = mixed_batch(batch, vocab, device, seed=batch)
        sampler = Sampler()
        host, wait = sample_once(sampler, logits, inp)
        problems = check_rows(logits, inp, host)
        started = time.perf_counter()
        for _ in range(iters):
            sampler(logits, inp).to_host()
        ms = (time.perf_counter() - started) * 1e3 / iters
        results.append(
            {
                "batch": batch,
                "vocab": vocab,
                "host_waits": (wait or "none")
                if device.type == "cuda"
                else "not checked (needs CUDA)",
                "problems": problems,
                "ms_per_call": round(ms, 3),
            }
        )
    verification = verify_waits(device, vocab)
    ok = all(not r["problems"] for r in results) and all(
        r["host_waits"] in ("none", "not checked (needs CUDA)") for r in results
    )
    ok = ok and verification["ok"]
    headers = ["batch", "vocab", "host waits in the sampler", "rows checked", "ms per call"]
    rows = [
        [r["batch"], r["vocab"], r["host_waits"], not r["problems"], r["ms_per_call"]]
        for r in results
    ]
    return {
        "ok": ok,
        "device": str(device),
        "results": results,
        "verification": verification,
        "table": markdown_table(headers, rows)
        + f"\n\nspeculative verification: {verification['line']}",
    }


def verify_waits(device: torch.device, vocab: int, seed: int = 0) -> dict[str, Any]:
    """Speculative verification (``gpu.spec_decode.verify``) of four sequences' 3-token drafts
    (greedy, sampled, seeded, with penalties) counted for host waits: it decides every row on
    the device and reads back once, through an event (``HostCopy``), which does not count."""
    from gpu.spec_decode import Proposal, verify
    from tools.gpu_check.sync_count import count_syncs

    rng = torch.Generator().manual_seed(seed)
    kinds = [ROW_KINDS[0], ROW_KINDS[2], ROW_KINDS[3], ROW_KINDS[5]]
    drafts = [Proposal(torch.randint(0, vocab, (3,), generator=rng).tolist()) for _ in kinds]
    logits = (torch.randn(4 * 4, vocab, generator=rng) * 3.0).to(device)
    inp = SamplerInput(
        list(kinds),
        [torch.randint(0, vocab, (16,), generator=rng).tolist() for _ in kinds],
        [torch.randint(0, vocab, (4,), generator=rng).tolist() for _ in kinds],
        [make_generator(p, device) for p in kinds],
    )
    sampler = Sampler()
    verify(sampler, logits, drafts, inp)  # warm
    result, waits = count_syncs(lambda: verify(sampler, logits, drafts, inp), device)
    shapes_ok = all(
        len(t) == a + 1 for t, a in zip(result.token_ids, result.num_accepted, strict=True)
    )
    if waits is None:
        line = "host waits not counted (needs CUDA)"
    else:
        line = f"{len(waits)} host waits" + (f" (first: {waits[0]})" if waits else "")
    return {"waits": waits, "tokens_ok": shapes_ok, "ok": shapes_ok and not waits, "line": line}
