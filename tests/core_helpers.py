"""Factories and a fake engine step for model-free tests of the scheduler and the page manager
(the shape of vLLM's tests/v1/core/utils.py): the rules run in milliseconds, no forward pass.

The engine's modules are imported here and nowhere else in those tests, so renaming one (e.g.
``gpu.page_manager.PageManager``) is a one-line change.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from common.page_hash import page_hashes
from gpu.page_manager import KVEvent, PageManager, PageTable
from gpu.sampling_params import SamplingParams
from gpu.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from gpu.sequence import FinishReason, SeqStatus, Sequence

__all__ = [
    "Core",
    "KVEvent",
    "PageManager",
    "PageTable",
    "SeqStatus",
    "Sequence",
    "StepResult",
    "check_pages",
    "make_core",
    "make_pages",
    "make_seq",
    "page_hashes",
    "tokens",
]

# Fresh token ids: every prompt and every fake sampled token is distinct from all others, so
# two sequences share a prefix only when a test gives them one (``prefix=``).
_fresh = itertools.count(1000)
_ids = itertools.count()


def tokens(n: int) -> list[int]:
    """``n`` token ids never used before in this process."""
    return [next(_fresh) for _ in range(n)]


def make_seq(
    prompt_len: int,
    max_tokens: int = 16,
    prefix: Seq[int] = (),
    request_id: str | None = None,
) -> Sequence:
    """A waiting sequence whose prompt is ``prefix`` followed by fresh tokens, ``prompt_len``
    tokens in all."""
    if len(prefix) > prompt_len:
        raise ValueError("the prefix is longer than the prompt")
    prompt = [*prefix, *tokens(prompt_len - len(prefix))]
    rid = request_id if request_id is not None else f"seq{next(_ids)}"
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def make_pages(num_pages: int, page_size: int, caching: bool = True) -> PageManager:
    return PageManager(num_pages, page_size, caching)


@dataclass
class StepResult:
    """One step, by request id: tokens scheduled (in the scheduler's order), sequences
    preempted, sequences that sampled a token, and those that finished."""

    scheduled: dict[str, int]
    preempted: list[str]
    sampled: list[str]
    finished: list[str]
    plan: SchedulerOutput

    @property
    def order(self) -> list[tuple[str, int]]:
        return list(self.scheduled.items())


@dataclass
class Core:
    """A scheduler over a page manager, driven like ``gpu.engine.Engine.step``: schedule ->
    (no forward) -> postprocess: advance ``num_computed``, hash the pages that are now full,
    and append one fake token to every sequence that caught up with its tokens; a sequence
    finishes at ``max_tokens`` or when it fills the whole pool (the engine's ``max_seq_len``)."""

    sched: Scheduler
    pages: PageManager
    live: dict[str, Sequence] = field(default_factory=dict)

    @property
    def max_seq_len(self) -> int:
        return self.pages.num_pages * self.pages.page_size

    def add(self, *seqs: Sequence) -> None:
        for seq in seqs:
            self.live[seq.request_id] = seq
            self.sched.add(seq)

    def abort(self, seq: Sequence) -> None:
        """What ``Engine.abort`` does to the scheduler and the pages."""
        del self.live[seq.request_id]
        self.sched.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = FinishReason.ABORT

    def step(self) -> StepResult:
        plan = self.sched.schedule()
        sampled, finished = [], []
        for item in plan.scheduled:
            seq = item.seq
            seq.num_computed += item.num_new
            self.pages.commit_full_pages(
                seq.table, seq.all_token_ids, min(seq.num_computed, seq.num_tokens)
            )
            if seq.num_computed < seq.num_tokens:
                continue  # a prompt chunk that is not the last one: nothing to sample
            seq.output_token_ids.append(next(_fresh))
            sampled.append(seq.request_id)
            if (
                len(seq.output_token_ids) >= seq.params.max_tokens
                or seq.num_tokens >= self.max_seq_len
            ):
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = FinishReason.LENGTH
                self.sched.remove(seq)
                del self.live[seq.request_id]
                finished.append(seq.request_id)
        return StepResult(
            {s.seq.request_id: s.num_new for s in plan.scheduled},
            [s.request_id for s in plan.preempted],
            sampled,
            finished,
            plan,
        )

    def run(self, max_steps: int = 1000) -> list[StepResult]:
        """Step until every sequence finished (failing after ``max_steps``: a livelock)."""
        results: list[StepResult] = []
        while self.live:
            assert len(results) < max_steps, "the scheduler stopped making progress"
            results.append(self.step())
        return results

    # -- what the tests look at ----------------------------------------------------------------
    def tables(self) -> list[PageTable]:
        return [s.table for s in self.live.values()]

    def check(self) -> None:
        check_pages(self.pages, self.tables())
        assert len(self.sched.running) <= self.sched.config.max_num_seqs


def check_pages(pm: PageManager, tables: list[PageTable]) -> None:
    """The page manager's own invariants, plus the two stated plainly: free + used == total,
    and no page is both available (free or evictable) and referenced."""
    pm.check_invariants(tables)
    used = {p for t in tables for p in t.pages}
    assert pm.num_free + len(used) == pm.num_pages, "free + used != total"
    available = set(pm.free_pages) | set(pm.evictable)
    assert not available & used, f"pages {sorted(available & used)} are free and referenced"
    assert all(pm.ref_counts[p] == sum(t.pages.count(p) for t in tables) for p in used)


def make_core(
    num_pages: int = 64,
    page_size: int = 4,
    budget: int = 512,
    max_seqs: int = 64,
    caching: bool = True,
) -> Core:
    pages = make_pages(num_pages, page_size, caching)
    return Core(Scheduler(SchedulerConfig(budget, max_seqs), pages), pages)
