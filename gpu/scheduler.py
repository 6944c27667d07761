"""Which sequences run this step, and how many tokens each (vLLM v1's single rule).

Decodes and unfinished prompt chunks of running sequences go first, in admission order, then
waiting sequences are admitted while the token budget and the page pool allow (chunked prefill:
a prompt larger than the remaining budget gets a chunk now and the rest in later steps). When a
running sequence cannot get a page, the newest running sequence is preempted: its pages are
released (their full pages stay in the prefix cache) and it waits at the queue's head to be
recomputed.

Guests (requests spilled in from another region, ``Sequence.guest``) wait behind every
sequence of this region's own clients, and when the batch is full (``max_num_seqs``) a
waiting own sequence preempts the newest running guest the same way: a guest never holds a
slot one of the region's clients waits for (it resumes, recomputed, when a slot frees).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from gpu.page_manager import PageManager
from gpu.prompt_logprobs import PROMPT_CHUNK_TOKENS
from gpu.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pages: PageManager,
        reserved: Mapping[str, Sequence] | None = None,
    ) -> None:
        self.config = config
        self.pages = pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Disaggregated decode: sequences whose prompt another executor computes hold a slot
        # from their reservation on (``gpu/handoff.py``), though they run only once it is here.
        self.reserved: Mapping[str, Sequence] = reserved if reserved is not None else {}
        # Since start: sequences preempted for want of pages, and guests that yielded a slot.
        self.num_preempted_for_pages = 0
        self._scoring_left = PROMPT_CHUNK_TOKENS  # (reset by each schedule)
        self.num_guests_yielded = 0

    def add(self, seq: Sequence) -> None:
        self._wait(seq, first=False)

    def _wait(self, seq: Sequence, first: bool) -> None:
        """Queue ``seq`` behind (``first``: ahead of) the waiting sequences of its kind; every
        own sequence waits ahead of every guest (module docstring)."""
        if seq.guest and not first:
            self.waiting.append(seq)
            return
        if not seq.guest and first:
            self.waiting.appendleft(seq)
            return
        if not seq.guest and not (self.waiting and self.waiting[-1].guest):
            self.waiting.append(seq)  # no guest waits: the usual case, O(1)
            return
        first_guest = next((i for i, s in enumerate(self.waiting) if s.guest), len(self.waiting))
        self.waiting.insert(first_guest, seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its pages (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pages.free(seq.table)

    @property
    def num_slots_taken(self) -> int:
        """Of ``max_num_seqs``: the running sequences and the reserved ones."""
        return len(self.running) + len(self.reserved)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        # prompt positions scored this step, over every scoring sequence (a logits row each)
        self._scoring_left = PROMPT_CHUNK_TOKENS
        scheduled: list[ScheduledSeq] = []
        yielded = self._yield_guests()
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending == 0:  # its in-flight token ends it (gpu/overlap.py): nothing to run
                i += 1
                continue
            num_new = self._chunk(seq, budget)
            if num_new == 0:  # a scoring sequence, this step's scoring rows taken by others
                i += 1
                continue
            while not self.pages.allocate(seq.table, seq.num_computed + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                self._take_scoring(seq, num_new)
                i += 1
                continue
            break  # seq itself was preempted: nothing after it remains in running
        self.num_preempted_for_pages += len(preempted)
        self.num_guests_yielded += len(yielded)
        if not preempted:
            budget = self._admit(budget, scheduled)
        return SchedulerOutput(scheduled, yielded + preempted)

    def _yield_guests(self) -> list[Sequence]:
        """Preempt the newest running guest for each waiting own sequence the full batch has
        no slot for; every guest then waits behind the own ones (module docstring)."""
        yielded: list[Sequence] = []
        if self.num_slots_taken < self.config.max_num_seqs:
            return yielded
        own_waiting = sum(not s.guest for s in self.waiting)
        while own_waiting > len(yielded) and self.num_slots_taken >= self.config.max_num_seqs:
            guests = [s for s in self.running if s.guest]
            if not guests:
                break
            self.running.remove(guests[-1])
            self._preempt(guests[-1])
            yielded.append(guests[-1])
        return yielded

    def _admit(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        while self.waiting and budget > 0 and self.num_slots_taken < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = (
                0
                if seq.every_prompt_position
                else self.pages.match_prefix(seq.table, seq.all_token_ids)
            )
            seq.num_computed = cached
            if not seq.admitted:
                seq.num_cached_prompt_tokens = min(cached, len(seq.prompt_token_ids))
            num_new = self._chunk(seq, budget)
            if num_new == 0 or not self.pages.allocate(seq.table, seq.num_computed + num_new):
                # Let go of the matched prefix: a waiting sequence holds no pages. Held, they
                # could lock out a sequence preempted ahead of it, with nothing left running.
                self.pages.free(seq.table)
                seq.num_computed = 0
                break
            self.waiting.popleft()
            if not seq.admitted:
                self.pages.record_lookup(len(seq.prompt_token_ids), seq.num_cached_prompt_tokens)
            seq.status = SeqStatus.RUNNING
            seq.admitted = True
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            self._take_scoring(seq, num_new)
        return budget

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens to compute for ``seq`` this step: what it has pending, within the budget
        (and, while it scores its prompt, within the step's ``PROMPT_CHUNK_TOKENS`` scoring
        rows that other scoring sequences left: a logits row each)."""
        limit = budget if seq.prompt_scoring is None else min(budget, self._scoring_left)
        return min(seq.num_pending, limit)

    def _take_scoring(self, seq: Sequence, num_new: int) -> None:
        if seq.prompt_scoring is not None:
            self._scoring_left -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.pages.free(seq.table)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self._wait(seq, first=True)
