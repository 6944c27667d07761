"""Warm-up: every kernel a replica will use is built, and one step of each kind run, at start.

The first step of each kind otherwise pays for what is built lazily: on the CPU the C kernels
(compiled or loaded from the cache folder), the OpenMP thread team and the fused decode table;
on CUDA FlashInfer's JIT modules (minutes when they are not prebuilt), cuBLAS handles and the
decode steps' CUDA graphs. Paid inside the engine thread after the executor joins the mesh,
that lands on the first requests' time to first token, and a heartbeat that says "idle" while
the thread compiles attracts work it cannot do. So the executor warms its engine up before its
first heartbeat (``services/executor/service.py``).

The warm-up runs the kinds of step the engine runs, in the order they first occur: a prompt
chunk (the prefill path: the batch-prefill wrapper on CUDA), then a decode step of the same
sequence (the decode path: the fused C decoder on CPU, the decode wrapper or a captured graph on
CUDA), then both sampler paths (greedy and seeded top-p) over its logits. It goes through the
runner, not the scheduler: no request is created, no prefix-cache lookup or hit is counted and
no page is hashed (no KV event reaches the index). The pages it borrows go back to the free
list; what it wrote into them is garbage that the next owner overwrites before reading.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from gpu.attention.metadata import SeqChunk
from gpu.linear import warm_triton_linears
from gpu.page_manager import PageManager, PageTable
from gpu.runner import ModelRunner
from gpu.sampling import Sampler, SamplerInput
from gpu.sampling_params import SamplingParams, make_generator

# Pages of the warm-up prompt (and one token more: the append crosses a page boundary); small
# enough for any pool and step budget that can serve a request at all.
PROMPT_PAGES = 1


@dataclass(frozen=True)
class WarmupReport:
    """What the warm-up ran and how long each part took (seconds). ``graphs_s``: capturing
    the decode steps' CUDA graphs and replaying one (None: this runner decodes eagerly);
    ``triton_s``: the Triton matmul kernels' variants built and tuned (None: the model uses
    none: ``--triton-gemv off`` and no int8 weights on CUDA)."""

    prompt_tokens: int
    prefill_s: float
    decode_s: float
    sample_s: float
    graphs_s: float | None = None
    triton_s: float | None = None

    @property
    def total_s(self) -> float:
        parts = (self.prefill_s, self.decode_s, self.sample_s, self.graphs_s, self.triton_s)
        return sum(p or 0.0 for p in parts)

    def describe(self) -> str:
        graphs = "" if self.graphs_s is None else f", CUDA graphs {self.graphs_s:.2f}s"
        if self.triton_s is not None:
            graphs += f", Triton matmul kernels {self.triton_s:.2f}s"
        return (
            f"{self.total_s:.2f}s (a prompt chunk of {self.prompt_tokens} tokens "
            f"{self.prefill_s:.2f}s, a decode step {self.decode_s:.2f}s, "
            f"sampling {self.sample_s:.2f}s{graphs})"
        )


def warmup_prompt_tokens(page_size: int, max_num_batched_tokens: int, max_seq_len: int) -> int:
    """The warm-up prompt's length: one page and one token, within the step budget and with
    room for two decoded tokens (eager, then from a CUDA graph). Raises ``ValueError`` when
    no prompt of two tokens fits."""
    n = min(PROMPT_PAGES * page_size + 1, max_num_batched_tokens, max_seq_len - 2)
    if n < 2:
        raise ValueError(
            f"cannot warm up: a step budget of {max_num_batched_tokens} tokens and a context "
            f"of {max_seq_len} leave no room for a prompt and two decoded tokens"
        )
    return n


def warm_up(
    runner: ModelRunner,
    pages: PageManager,
    sampler: Sampler,
    max_num_batched_tokens: int,
    max_seq_len: int,
    max_num_seqs: int = 1,
) -> WarmupReport:
    """Run a prompt chunk, a decode step and both sampler paths on ``runner`` with pages
    borrowed from ``pages`` and returned (call it before any request arrives: it needs
    ``warmup_prompt_tokens`` + 2 free pages' worth of tokens). A runner with CUDA graphs
    then captures them for batches up to ``max_num_seqs`` and replays a second decode step."""
    n = warmup_prompt_tokens(pages.page_size, max_num_batched_tokens, max_seq_len)
    vocab = runner.config.vocab_size
    # Arbitrary but valid ids; the values do not matter, only the shapes and the paths.
    prompt = [(7 * i + 1) % vocab for i in range(n)]
    table = PageTable()
    if not pages.allocate(table, n + 2):
        raise ValueError(
            f"cannot warm up: {n + 2} tokens need "
            f"{pages.pages_needed(PageTable(), n + 2)} pages, {pages.num_free} free"
        )
    try:
        # First every Triton matrix-vector variant at every row block and every int8 GEMM
        # bucket (compiled and tuned here, not inside the steps timed below or the graphs'
        # capture).
        started = time.perf_counter()
        triton_s = None
        warmed = runner.model.warm_triton_gemv()
        warmed += warm_triton_linears(
            runner.model.modules(), max_num_batched_tokens, runner.model.dtype
        )
        if warmed:
            _sync(runner.device)
            triton_s = time.perf_counter() - started
            started = time.perf_counter()
        runner.execute([SeqChunk(tuple(table.pages), 0, n)], [prompt])
        _sync(runner.device)
        prefilled = time.perf_counter()
        logits = runner.execute([SeqChunk(tuple(table.pages), n, 1)], [[prompt[-1]]])
        _sync(runner.device)
        decoded = time.perf_counter()
        greedy = SamplingParams(temperature=0.0)
        sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=0)
        both = torch.cat([logits, logits])
        sampler(
            both,
            SamplerInput(
                params=[greedy, sampled],
                prompt_token_ids=[prompt, prompt],
                output_token_ids=[[], []],
                generators=[None, make_generator(sampled, runner.device)],
            ),
        )
        _sync(runner.device)
        done = time.perf_counter()
        graphs_s = runner.capture_graphs(max_num_seqs)
        if graphs_s is not None:  # the step after: a decode replayed from its graph
            replay_started = time.perf_counter()
            runner.execute([SeqChunk(tuple(table.pages), n + 1, 1)], [[prompt[-1]]])
            _sync(runner.device)
            graphs_s += time.perf_counter() - replay_started
    finally:
        pages.free(table)
    sample_s = done - decoded
    return WarmupReport(n, prefilled - started, decoded - prefilled, sample_s, graphs_s, triton_s)


def _sync(device: torch.device) -> None:
    """Kernels launch asynchronously on CUDA: a part's time is its kernels' time only after
    they finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
