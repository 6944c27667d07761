"""The GPU check's ``overlap`` section: whole engine steps, one after another against
overlapped (``gpu/overlap.py``), on the same model and requests.

A plain step waits for its tokens and only then schedules and builds the next one, so the
device idles for the host's share of every step; overlapped, the next step is queued first.
The section runs the same greedy batch (``batch`` requests of ``prompt_tokens`` random tokens,
``new_tokens`` each, stop tokens ignored) through ``Engine.generate`` in both modes, warmed
alike and then timed alternately (plain, overlapped, plain, ...; median of ``rounds`` each),
and reports tokens/s, ms per step and whether both modes produced the same tokens (they must:
greedy, and the overlapped loop changes when tokens are read, not what is computed). After the
warm-up the prompts come from the prefix cache: the timed runs are mostly decode steps, where
the host's share of a step is largest.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any

import torch

from gpu.engine import Engine, EngineConfig
from gpu.model import CausalLM
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from tools.gpu_check.common import markdown_table

PAGE_SIZE = 16


def _engine(model: CausalLM, overlap: bool, batch: int, tokens: int, graphs: bool) -> Engine:
    pages = batch * -(-tokens // PAGE_SIZE) + 1
    runner = ModelRunner(model, pages, PAGE_SIZE, cuda_graphs=graphs)
    runner.capture_graphs(batch)
    config = EngineConfig(max_num_batched_tokens=max(512, batch), max_num_seqs=batch,
                          overlap_steps=overlap)  # fmt: skip
    return Engine(runner, config, eos_token_ids=[])


def overlap_section(
    model: CausalLM,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    rounds: int = 3,
    graphs: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (batch, prompt_tokens), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    engines = {
        name: _engine(model, overlap, batch, prompt_tokens + new_tokens, graphs)
        for name, overlap in (("plain", False), ("overlapped", True))
    }
    outputs = {name: e.generate(prompts, params) for name, e in engines.items()}  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    steps: dict[str, int] = {}
    for _ in range(rounds):
        for name, engine in engines.items():
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            before = engine.num_forward_passes
            started = time.perf_counter()
            engine.generate(prompts, params)
            seconds[name].append(time.perf_counter() - started)
            steps[name] = engine.num_forward_passes - before
    results: dict[str, dict[str, Any]] = {}
    for name in engines:
        s = statistics.median(seconds[name])
        results[name] = {
            "seconds": s,
            "tokens_per_s": batch * new_tokens / s,
            "ms_per_step": s * 1000 / steps[name],
            "samples_s": seconds[name],
            "overlapping": engines[name].overlap is not None,
        }
    from tools.gpu_check.sync_count import count_syncs

    for name, engine in engines.items():  # host waits in whole runs (an event's do not count)
        _, waits = count_syncs(partial(engine.generate, prompts, params), model.device)
        results[name]["host_waits"] = None if waits is None else len(waits)
        results[name]["first_host_wait"] = waits[0] if waits else None
    same = outputs["plain"] == outputs["overlapped"]
    speedup = results["plain"]["seconds"] / results["overlapped"]["seconds"]
    rows = [[name, round(r["tokens_per_s"], 1), round(r["ms_per_step"], 3), r["host_waits"]]
            for name, r in results.items()]  # fmt: skip
    headers = ["engine steps", "tokens/s", "ms/step", "host waits in a run"]
    table = markdown_table(headers, rows) + (
        f"\n\nbatch {batch}, {prompt_tokens} prompt + {new_tokens} new tokens each, greedy; "
        f"graphs {graphs}; overlapped / plain {speedup:.3f}x; same tokens: {same}"
    )
    return {
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "graphs": graphs,
        "results": results,
        "speedup": speedup,
        "same_tokens": same,
        "ok": same and results["overlapped"]["overlapping"],
        "table": table,
    }
