"""The overlapped step loop: the next step is scheduled, built and queued on the device before
the last step's tokens are read back, so the device does not wait for the host between steps.

A plain step ends with one wait for the device (the sampled tokens), and only then does the
host post-process them, schedule the next step, build its metadata and plan its attention:
the device idles all that while. Overlapped (``EngineConfig.overlap_steps``), one call does:

1. Every sequence that sampled in the step still in flight counts its token, unknown to the
   host yet, as one more token (``Sequence.num_inflight``; ``token_ids_at`` gives
   ``INFLIGHT_TOKEN`` for it), except one that this token is sure to end (``max_tokens``, the
   context length): nothing more is computed for it.
2. The scheduler runs as always; the runner builds the step and queues its forward pass, the
   in-flight tokens fed from the device (``gpu.runner.TokenFeed``: the last sampling's output
   tensor, by row). ``num_computed`` advances at launch.
3. The last step's tokens are read back (their copy was queued right after its sampling, and
   the wait is for that copy alone, ``gpu.transfers.HostCopy``), its sequences' full pages
   are committed to the prefix cache, and its tokens emitted: stop tokens, grammars and
   limits end sequences exactly as in a plain step.
4. The new step's sampling is queued for the sequences still alive (one the last token ended
   ran one row in vain: its row is dropped), with penalties and grammar masks that now know
   the last token, and its copy to the host is queued.

So a call returns the tokens of the step before it, and a sequence ended by a stop token costs
one wasted row; until its token is read it also keeps its pages, its slot and its share of the
budget through the next schedule (a waiting request is admitted one step later). The device
runs the steps in order on one stream, so a page freed or committed while a step still writes
to it is read by later steps only after that write; a writer outside the stream (a KV
transfer into reserved pages) waits for the device first (``Engine.settle_device``). Off where
drafts are verified (they are proposed from known tokens) and for a tensor-parallel replica
(its step is sent to the other ranks with its tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gpu.attention.metadata import SeqChunk
from gpu.runner import TokenFeed
from gpu.sampling import PendingSample, SamplerOutput
from gpu.scheduler import SchedulerOutput
from gpu.sequence import INFLIGHT_TOKEN, SeqStatus, Sequence

if TYPE_CHECKING:
    from gpu.engine import Engine, StepOutput


def overlap_blocker(num_speculative_tokens: int, tensor_parallel: bool) -> str | None:
    """Why an engine cannot overlap its steps, or None."""
    if num_speculative_tokens:
        return "speculative decoding proposes drafts from the tokens the host holds"
    if tensor_parallel:
        return "a tensor-parallel step is sent to the other ranks with its tokens"
    return None


@dataclass
class _Launched:
    """A step whose forward pass is queued."""

    scheduled: list[Sequence]
    samplers: list[tuple[Sequence, int]]  # (sequence, its logits row): caught up, they sample
    logits: torch.Tensor


@dataclass
class _InFlight:
    """A step whose sampling is queued and whose tokens are on their way to the host."""

    scheduled: list[Sequence]
    samplers: list[Sequence]  # row i of the sampled tokens
    sampled: SamplerOutput
    pending: PendingSample


class OverlappedSteps:
    """``Engine.step`` when the engine overlaps its steps (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inflight: _InFlight | None = None
        self.dropped_rows = 0  # rows run for a sequence the last token had ended

    def step(self) -> list[StepOutput]:
        engine = self.engine
        prev, self.inflight = self.inflight, None
        feeding: dict[str, int] = {}  # request id -> its row of prev's sampled tokens
        if prev is not None:
            for row, seq in enumerate(prev.samplers):
                if self._alive(seq) and not self._ends_by_length(seq):
                    seq.num_inflight = 1
                    feeding[seq.request_id] = row
        try:
            plan = engine.scheduler.schedule()
            launched = self._launch(plan, prev, feeding) if plan.scheduled else None
            outputs = self._finish(prev) if prev is not None else []
        except BaseException:
            # The step in flight is lost with the error: no token of it is left counted.
            for seq in prev.samplers if prev is not None else []:
                seq.num_inflight = 0
            raise
        if launched is not None:
            self.inflight = self._sample(launched)
        return outputs

    @property
    def num_inflight_tokens(self) -> int:
        return 0 if self.inflight is None else len(self.inflight.samplers)

    def _alive(self, seq: Sequence) -> bool:
        return self.engine.seqs.get(seq.request_id) is seq

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the token in flight ends ``seq`` whatever it is (its limits)."""
        out = len(seq.output_token_ids) + 1
        return out >= seq.params.max_tokens or seq.num_tokens + 1 >= self.engine.max_seq_len

    def _launch(
        self, plan: SchedulerOutput, prev: _InFlight | None, feeding: dict[str, int]
    ) -> _Launched:
        engine = self.engine
        chunks, tokens, positions, rows = [], [], [], []
        flat = 0
        for item in plan.scheduled:
            seq = item.seq
            chunks.append(
                SeqChunk(tuple(seq.table.pages), seq.num_computed, item.num_new, seq.adapter)
            )
            ids = seq.token_ids_at(seq.num_computed, item.num_new)
            for j, token in enumerate(ids):
                if token == INFLIGHT_TOKEN:
                    positions.append(flat + j)
                    rows.append(feeding[seq.request_id])
            tokens.append(ids)
            flat += item.num_new
        feed = None
        if positions:
            assert prev is not None  # only its samplers hold a token in flight
            feed = TokenFeed(prev.sampled.token_ids, positions, rows)
        # One logits row per chunk, or one per prompt position a scoring sequence scores
        # (gpu/prompt_logprobs): no drafts here.
        num_rows = [engine._logits_rows(item.seq, item.num_new) for item in plan.scheduled]
        several = any(n > 1 for n in num_rows)
        engine.num_forward_passes += 1
        tap = engine._pooling_tap(plan)
        logits = engine.runner.execute(
            chunks, tokens, feed=feed, num_logits=num_rows if several else None, tap=tap
        )
        if tap is not None:
            tap.hand_out()
        samplers = []
        row = 0
        for item, n in zip(plan.scheduled, num_rows, strict=True):
            engine._score_prompt(item.seq, item.num_new, logits, row)
            item.seq.num_computed += item.num_new
            if item.seq.num_computed >= item.seq.num_tokens:
                samplers.append((item.seq, row + n - 1))
            row += n
        return _Launched([item.seq for item in plan.scheduled], samplers, logits)

    def _finish(self, prev: _InFlight) -> list[StepOutput]:
        """Read ``prev``'s tokens back, commit its full pages and emit the tokens."""
        engine = self.engine
        host = prev.pending.wait()
        self._commit(prev.scheduled)
        rows = []
        for row, seq in enumerate(prev.samplers):
            if self._alive(seq):  # (not aborted meanwhile)
                seq.num_inflight = 0
                rows.append((row, seq))
        engine.num_steps += bool(rows)
        return engine._emit_sampled(rows, host)

    def _commit(self, seqs: list[Sequence]) -> None:
        """The full pages of known tokens of ``seqs`` still running, into the prefix cache."""
        for seq in seqs:
            if self._alive(seq) and seq.status is SeqStatus.RUNNING:
                known = min(seq.num_computed, len(seq.all_token_ids))
                self.engine.pages.commit_full_pages(seq.table, seq.all_token_ids, known)

    def _sample(self, launched: _Launched) -> _InFlight | None:
        engine = self.engine
        samplers = [(s, r) for s, r in launched.samplers if self._alive(s)]
        self.dropped_rows += len(launched.samplers) - len(samplers)
        if not samplers:
            self._commit(launched.scheduled)  # prompt chunks only: their pages commit now
            return None
        seqs = [s for s, _ in samplers]
        sampled = engine._launch_sample(seqs, [r for _, r in samplers], launched.logits)
        return _InFlight(launched.scheduled, seqs, sampled, sampled.start_to_host())
