"""The continuous-batching engine: add requests any time, abort any time, ``step()`` until done.

One step reads top to bottom: (propose) -> schedule -> build the batch -> forward -> sample or
verify -> postprocess. With ``overlap_steps`` the next step is queued before the last one's
tokens are read (``gpu/overlap.py``). No NATS here; the executor service drives ``step()`` off
its event loop.

Speculative decoding (``num_speculative_tokens`` > 0): before a step, every sequence that will
decode gets a draft of up to k tokens (``draft_requests`` -> a proposer -> ``set_drafts``). An
in-process proposer passed to the engine is called by ``step()`` itself; a remote one (the
speculator service) is awaited by the executor between steps, which then calls ``set_drafts``
and ``step()``, so the worker thread never waits on the network. A draft raises the
sequence's target, the scheduler computes it like any chunk, and ``gpu.spec_decode.verify``
accepts a prefix of it; the rejected positions fall back off ``num_computed`` and their pages
are released.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from common.page_hash import namespace_root
from gpu.attention.metadata import SeqChunk
from gpu.config import ModelError
from gpu.overlap import OverlappedSteps, overlap_blocker
from gpu.page_manager import KVEvent, PageManager
from gpu.pooling import HiddenTap, PromptPooling
from gpu.prompt_logprobs import PromptLogprobs, PromptScoring
from gpu.runner import ModelRunner
from gpu.sampling import SampledOnHost, Sampler, SamplerInput, SamplerOutput
from gpu.sampling_params import SamplingParams, make_generator, skip_draws
from gpu.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from gpu.sequence import FinishReason, SeqStatus, Sequence
from gpu.spec_decode import DraftLength, DraftRequest, Proposal, Proposer, SpecStats, verify
from gpu.transfers import move, to_device
from gpu.warmup import WarmupReport, warm_up

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    num_speculative_tokens: int = 0  # k: draft tokens verified per decode step (0: off)
    adaptive_speculation: bool = True  # per-sequence k falls when drafts are rejected
    # Queue each step before reading the last one's tokens (gpu/overlap.py): a step() then
    # returns the tokens of the step before it.
    overlap_steps: bool = False
    # What logprobs are taken from (gpu/sampling.py, which checks it): the model's logits
    # ("raw", vLLM's default) or those sampled from ("processed")
    logprobs_mode: str = "raw"

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and its top ``(token id, logprob)`` alternatives (on the
    wire: ``common.wire.detokenizer.WireTokenLogprob``)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    # The last new token is a stop token (an EOS, or one of ``stop_token_ids``) that ended the
    # sequence: counted and kept, but its text is not part of the completion (as in vLLM).
    stop_token: bool = False
    # With the first token of a request that asked for them (``gpu.prompt_logprobs``)
    prompt_logprobs: PromptLogprobs | None = None
    # With the first token of an embedding request: its vector (``gpu.pooling``)
    embedding: list[float] | None = None


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig | None = None,
        eos_token_ids: Iterable[int] = (),
        proposer: Proposer | None = None,
    ) -> None:
        self.runner = runner
        self.config = config or EngineConfig()
        if proposer is not None and not self.config.num_speculative_tokens:
            raise ValueError("a proposer needs num_speculative_tokens >= 1")
        self.proposer = proposer
        self.spec = SpecStats()
        self.pages = PageManager(
            runner.kv.spec.num_pages, runner.page_size, self.config.enable_prefix_caching
        )
        self.sampler = Sampler(logprobs_mode=self.config.logprobs_mode)
        self.eos_token_ids = frozenset(eos_token_ids or runner.config.eos_token_ids)
        self.eos_ids = tuple(sorted(self.eos_token_ids))  # (for the sampler, every step)
        self.seqs: dict[str, Sequence] = {}
        # Disaggregated decode: sequences whose prompt KV another executor is writing into
        # their pages (``gpu/handoff.py``); not scheduled until it arrives.
        self.reserved: dict[str, Sequence] = {}
        self.scheduler = Scheduler(self.config.scheduler, self.pages, self.reserved)
        self.num_steps = 0
        self.num_forward_passes = 0  # target forward passes (a step that ran the model)
        self._draft_limits: dict[str, int] = {}  # the last draft_requests' k per sequence
        self._offline_ids = itertools.count()
        self.overlap: OverlappedSteps | None = None
        if self.config.overlap_steps:
            blocker = overlap_blocker(self.config.num_speculative_tokens, runner.peers is not None)
            if blocker is None:
                self.overlap = OverlappedSteps(self)
            else:
                log.warning("engine: steps run one after the other: %s", blocker)

    @property
    def max_seq_len(self) -> int:
        """A sequence never grows past the context length or what the KV pool holds."""
        return min(self.runner.max_model_len, self.runner.kv.spec.num_tokens)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
        grammar: Any = None,
        guest: bool = False,
        lora: str = "",
        grammar_after: int | None = None,
        grammar_open: int | None = None,
    ) -> None:
        """Queue a request; raises ``ModelError``/``ValueError`` naming what is wrong with it.

        ``lora``: the LoRA adapter it runs with (a name ``runner.load_loras`` gave; "": none).

        ``guest``: spilled in from another region; preempted for this region's own requests
        when the batch is full (``gpu/scheduler.py``).

        ``grammar``: an ``xgrammar.CompiledGrammar`` (for this model's vocabulary and
        ``eos_token_ids``) the output must follow (``gpu.grammar``); compiled by the caller,
        off the step loop; ``grammar_after``: it holds only after the model wrote this token
        (the end of its reasoning), and with ``grammar_open`` only if the answer starts with
        that one (``gpu.grammar.GrammarState``).

        ``output_token_ids``: tokens this request already generated elsewhere (a request
        migrated off a lost executor). They are prefilled with the prompt, count towards
        ``max_tokens`` and the penalties, and a seeded request's generator skips the draws
        they took, so the continuation is the one an uninterrupted run would have sampled.
        """
        seq = self.new_sequence(
            request_id, prompt_token_ids, params, output_token_ids, grammar, lora,
            grammar_after, grammar_open,
        )  # fmt: skip
        seq.guest = guest
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def release_loras(self) -> None:
        """Free unloaded adapters no sequence uses now, and with them every unreferenced
        cached page (theirs among them: one loaded later under the name must not find them;
        pages carry no record of their chain's root); between steps, on the engine's
        thread."""
        if self.runner.loras.retired:
            held = [*self.seqs.values(), *self.reserved.values()]
            if self.runner.loras.release({seq.adapter for seq in held}):
                self.pages.reset_prefix_cache()

    def new_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
        grammar: Any = None,
        lora: str = "",
        grammar_after: int | None = None,
        grammar_open: int | None = None,
    ) -> Sequence:
        """A checked new sequence (for ``add_request`` and ``gpu.handoff.reserve``)."""
        if request_id in self.seqs or request_id in self.reserved:
            raise ValueError(f"request id {request_id!r} is already in use")
        adapter = self.runner.loras.slot(lora)
        if not prompt_token_ids:
            raise ModelError("the prompt is empty")
        output_token_ids = output_token_ids or []
        self.runner.check_prompt([*prompt_token_ids, *output_token_ids])
        total = len(prompt_token_ids) + len(output_token_ids)
        # (an embedding's one token is never computed: its prompt may fill the context)
        fits = self.max_seq_len if params.pooling else self.max_seq_len - 1
        if total > fits:
            room = "" if params.pooling else " with room for one output token"
            raise ModelError(f"prompt has {total} tokens; at most {fits} fit{room}")
        if len(output_token_ids) >= params.max_tokens:
            raise ValueError("the request already generated max_tokens tokens")
        listed = {
            "logit_bias": [t for t, _ in params.logit_bias],
            "allowed_token_ids": params.allowed_token_ids,
            "bad_words": [t for word in params.bad_words_token_ids for t in word],
        }
        for name, token_ids in listed.items():
            try:
                self.runner.check_token_ids(token_ids)
            except ModelError as exc:
                raise ValueError(f"{name}: {exc}") from None
        # (what the sampler bans at the first step: gpu.sampling.SamplerInput.banned_tokens)
        banned = {
            *params.stop_ids_banned(self.eos_ids, len(output_token_ids)),
            *params.bad_word_ends(output_token_ids),
        }
        if params.allowed_token_ids and params.allowed_set <= banned:
            raise ValueError(
                "allowed_token_ids: every allowed token is banned (a stop token under "
                "min_tokens, or a bad word), so nothing could be generated"
            )
        seq = Sequence(request_id, list(prompt_token_ids), params, adapter=adapter)
        seq.table.root = namespace_root(lora)  # (its KV is the adapter's: cached apart)
        seq.output_token_ids = list(output_token_ids)
        if params.prompt_logprobs is not None and not output_token_ids:
            # (a continuation's client has them: they came with its first token)
            seq.prompt_scoring = PromptScoring(params.prompt_logprobs)
        if params.pooling and not output_token_ids:  # (a continuation's client has it too)
            dims = params.pooling_dimensions
            if dims is not None and dims > self.runner.config.hidden_size:
                raise ValueError(
                    f"pooling_dimensions {dims} is more than the model's hidden size "
                    f"{self.runner.config.hidden_size}"
                )
            seq.pooling = PromptPooling(params.pooling, dims, params.pooling_normalize is not False)
        if grammar is not None:
            # gpu.grammar loads xgrammar (~0.6 s more than torch): only an engine that meets
            # a constrained request pays it, not every process that imports the engine.
            from gpu.grammar import GrammarState

            seq.grammar = GrammarState(
                grammar, sorted(self.eos_token_ids), grammar_after, grammar_open
            )
            if not seq.grammar.accept(output_token_ids):
                raise ValueError("the tokens already generated do not follow the grammar")
        seq.generator = make_generator(params, self.runner.device)
        if seq.generator is not None and not params.is_greedy:
            skip_draws(seq.generator, len(output_token_ids), self.runner.config.vocab_size)
        if self.config.num_speculative_tokens:
            seq.draft_length = DraftLength(self.config.num_speculative_tokens)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages; False if it is unknown or already done."""
        reserved = self.reserved.pop(request_id, None)
        if reserved is not None:  # pages held for a prompt another executor computes
            self.pages.free(reserved.table)
            return True
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = FinishReason.ABORT
        if self.proposer is not None:
            self.proposer.release([request_id])
        return True

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    @property
    def num_inflight_tokens(self) -> int:
        """Tokens sampled on the device and not read yet (overlapped steps; load reports)."""
        return 0 if self.overlap is None else self.overlap.num_inflight_tokens

    def settle_device(self) -> None:
        """Wait until the device has run every step queued so far. Pages freed meanwhile may
        be written by a step still running: one handed to a writer outside the stream (a KV
        transfer into reserved pages) must wait for it."""
        if self.runner.device.type == "cuda":
            stream = torch.cuda.current_stream(self.runner.device)
            if not stream.query():
                stream.synchronize()

    def warm_up(self) -> WarmupReport:
        """Build every kernel the steps use and run one step of each kind (``gpu.warmup``);
        only before the first request: it borrows pages a request would need."""
        if self.seqs or self.reserved:
            raise RuntimeError("warm up before the first request, not while sequences run")
        return warm_up(
            self.runner, self.pages, self.sampler, self.config.max_num_batched_tokens,
            self.max_seq_len, self.config.max_num_seqs,
        )  # fmt: skip

    def drain_kv_events(self) -> list[KVEvent]:
        return self.pages.drain_events()

    # -- speculation ----------------------------------------------------------------------------
    def draft_requests(self) -> list[DraftRequest]:
        """The running sequences that decode next step, each with the draft length it may use
        (its adaptive k, capped so a draft never outruns ``max_tokens`` or the context, and so
        drafts only take pages and batch tokens no running sequence's own step needs: a draft
        never preempts a sequence nor keeps one out of the step)."""
        if not self.config.num_speculative_tokens:
            return []
        requests = []
        self._draft_limits = {}
        # What every running sequence's own next step takes first, pages and batch tokens, in
        # the order the scheduler serves them; drafts get only what is left of both. Pages a
        # draft took from a later sequence's decode or prompt chunk would preempt it, and batch
        # tokens it took would keep that sequence out of the step.
        free = self.pages.num_free
        budget = self.config.max_num_batched_tokens
        for seq in self.scheduler.running:
            own = min(seq.num_pending, budget)
            budget -= own
            free -= self.pages.pages_needed(seq.table, seq.num_computed + own)
        for seq in self.scheduler.running:
            if seq.num_pending != 1 or seq.draft_length is None or budget <= 0:
                continue
            k = (
                seq.draft_length.next()
                if self.config.adaptive_speculation
                else seq.draft_length.max_k
            )
            k = min(k, self._draft_room(seq), budget)
            decode = self.pages.pages_needed(seq.table, seq.num_tokens)  # (counted above)
            while k > 0 and self.pages.pages_needed(seq.table, seq.num_tokens + k) - decode > free:
                k -= 1
            if k > 0:
                free -= self.pages.pages_needed(seq.table, seq.num_tokens + k) - decode
                budget -= k
                self._draft_limits[seq.request_id] = k
                requests.append(
                    DraftRequest(
                        seq.request_id, seq.all_token_ids, len(seq.prompt_token_ids), k, seq.params
                    )
                )
        return requests

    def set_drafts(self, proposals: Mapping[str, Proposal]) -> None:
        """Attach drafts to the sequences ``draft_requests`` asked for, cut to the length it
        allowed. A draft for a sequence that was not asked for, is gone or changed since, or
        holds out-of-range ids is dropped."""
        for request_id, proposal in proposals.items():
            seq = self.seqs.get(request_id)
            if seq is None or seq.status is not SeqStatus.RUNNING or seq.num_pending != 1:
                continue
            proposal = proposal.truncated(self._draft_limits.get(request_id, 0))
            try:
                self.runner.check_token_ids(proposal.token_ids)
                for support in proposal.q_ids or []:  # index_put_ on these: out of range
                    self.runner.check_token_ids(support)  # raises, a negative one wraps
            except ModelError:
                continue
            seq.draft = proposal if len(proposal) else None

    def _draft_room(self, seq: Sequence) -> int:
        """Draft tokens that can still be used: the step emits at most k + 1 tokens, and the k
        drafts occupy positions up to ``num_tokens + k - 1``."""
        room_out = seq.params.max_tokens - len(seq.output_token_ids) - 1
        return max(0, min(room_out, self.max_seq_len - seq.num_tokens))

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        self.release_loras()
        if self.overlap is not None:
            return self.overlap.step()
        if self.proposer is not None:
            requests = self.draft_requests()
            if requests:
                self.set_drafts(self.proposer.propose(requests))
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            seq.draft = None  # recomputed from scratch; a new draft comes when it decodes
        if not plan.scheduled:
            return []
        tap = self._pooling_tap(plan)
        logits = self._forward(plan, tap)
        if tap is not None:
            tap.hand_out()
        return self._postprocess(plan, logits)

    @staticmethod
    def _logits_rows(seq: Sequence, num_new: int) -> int:
        """Logits rows a scheduled chunk needs: its last token's, plus one per draft token the
        chunk reaches (verified this step; a draft cut short by the budget is truncated), or
        one per prompt position it scores (``gpu.prompt_logprobs``)."""
        if seq.prompt_scoring is not None:
            return seq.prompt_scoring.rows(seq.num_computed, num_new, len(seq.prompt_token_ids))
        end = seq.num_computed + num_new
        if seq.draft is None or end < seq.num_tokens:
            return 1
        return end - seq.num_tokens + 1

    @staticmethod
    def _score_prompt(seq: Sequence, num_new: int, logits: torch.Tensor, first_row: int) -> None:
        """Queue the prompt logprobs of a scoring sequence's chunk (before ``num_computed``
        moves past it)."""
        if seq.prompt_scoring is not None:
            seq.prompt_scoring.queue(
                logits, first_row, seq.num_computed, num_new, seq.prompt_token_ids
            )

    @staticmethod
    def _pooling_tap(plan: SchedulerOutput) -> HiddenTap | None:
        """The step's rows whose final hidden states its embedding sequences pool."""
        tap = HiddenTap()
        flat = 0
        for item in plan.scheduled:
            seq = item.seq
            if seq.pooling is not None:
                tap.add(
                    seq.pooling, flat, seq.num_computed, item.num_new, len(seq.prompt_token_ids)
                )
            flat += item.num_new
        return tap if tap.parts else None

    def _forward(self, plan: SchedulerOutput, tap: HiddenTap | None = None) -> torch.Tensor:
        chunks = []
        tokens: list[list[int]] = []
        rows = []
        for item in plan.scheduled:
            seq = item.seq
            chunks.append(
                SeqChunk(tuple(seq.table.pages), seq.num_computed, item.num_new, seq.adapter)
            )
            tokens.append(seq.token_ids_at(seq.num_computed, item.num_new))
            rows.append(self._logits_rows(seq, item.num_new))
        several = any(n > 1 for n in rows)
        self.num_forward_passes += 1
        return self.runner.execute(chunks, tokens, num_logits=rows if several else None, tap=tap)

    def _postprocess(self, plan: SchedulerOutput, logits: torch.Tensor) -> list[StepOutput]:
        # Only sequences that caught up with their real tokens sample (or verify their draft);
        # a prompt chunk that is not the last one just advances num_computed.
        plain: list[tuple[Sequence, int]] = []  # (sequence, its logits row)
        spec: list[tuple[Sequence, int]] = []  # (sequence, its first logits row)
        row = 0
        for item in plan.scheduled:
            seq = item.seq
            num_rows = self._logits_rows(seq, item.num_new)
            self._score_prompt(seq, item.num_new, logits, row)
            seq.num_computed += item.num_new
            self.pages.commit_full_pages(
                seq.table, seq.all_token_ids, min(seq.num_computed, seq.num_tokens)
            )
            if seq.num_computed >= seq.num_tokens:
                if num_rows > 1 and seq.draft is not None:
                    seq.draft = seq.draft.truncated(num_rows - 1)
                    spec.append((seq, row))
                else:
                    seq.draft = None
                    plain.append((seq, row + num_rows - 1))
            row += num_rows
        if not plain and not spec:
            return []
        outputs = self._sample(plain, logits) + self._verify(spec, logits)
        self.num_steps += 1
        return outputs

    def _sample(self, plain: list[tuple[Sequence, int]], logits: torch.Tensor) -> list[StepOutput]:
        if not plain:
            return []
        seqs = [s for s, _ in plain]
        sampled = self._launch_sample(seqs, [r for _, r in plain], logits)
        return self._emit_sampled(list(enumerate(seqs)), sampled.to_host())  # the step's wait

    def _launch_sample(
        self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor
    ) -> SamplerOutput:
        """Queue the sampling of ``seqs`` from their ``rows`` of ``logits`` (grammar masks
        included); nothing is read back."""
        inp = self._sampler_input(seqs)
        constrained = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:
            from gpu.grammar import allocate_bitmask

            bitmask = allocate_bitmask(len(seqs), logits.shape[1])
            # (a row whose grammar waits for the end of the reasoning is not limited: the
            # sampler treats it as free, min_tokens' stop bans included)
            limited = [i for i, state in constrained if state.next_mask(bitmask, i)]
            if limited:
                inp.token_bitmask = move(bitmask, logits.device)
                inp.masked_rows = limited
        return self.sampler(self._rows_of(logits, rows), inp)

    @staticmethod
    def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``logits[rows]`` without a host wait (a list index is a pageable copy, which waits
        for the stream on CUDA: for the next step's forward pass, when steps overlap)."""
        if rows == list(range(logits.shape[0])):
            return logits
        return logits.index_select(0, to_device(rows, torch.int64, logits.device))

    def _emit_sampled(
        self, rows: list[tuple[int, Sequence]], host: SampledOnHost
    ) -> list[StepOutput]:
        """Each ``(row, sequence)``'s token (and logprobs) of a sampling read back."""
        outputs = []
        for i, seq in rows:
            logprobs = None
            token = host.token_ids[i]
            if seq.params.logprobs is not None and host.logprobs is not None:
                top = host.top_logprobs[i] if host.top_logprobs else []
                logprobs = [TokenLogprob(token, host.logprobs[i], top)]
            outputs.append(self._emit(seq, [token], logprobs))
        return outputs

    def _verify(self, spec: list[tuple[Sequence, int]], logits: torch.Tensor) -> list[StepOutput]:
        if not spec:
            return []
        seqs = [s for s, _ in spec]
        drafts = [s.draft for s in seqs if s.draft is not None]
        rows = [r + j for (s, r), d in zip(spec, drafts, strict=True) for j in range(len(d) + 1)]
        inp = self._sampler_input(seqs)
        self._draft_masks(seqs, drafts, inp, logits.shape[1], logits.device)
        rows_logits = self._rows_of(logits, rows)
        result = verify(self.sampler, rows_logits, drafts, inp)
        logprobs = self._spec_logprobs(
            seqs, result.token_ids, rows_logits, inp, result.processed, result.row_starts
        )
        outputs = []
        for i, seq in enumerate(seqs):
            num_draft, accepted = len(drafts[i]), result.num_accepted[i]
            if seq.draft_length is not None and self.config.adaptive_speculation:
                seq.draft_length.update(num_draft, accepted)
            # KV is valid for the real tokens and the accepted drafts; the rejected positions
            # are recomputed (rolled back) and their pages released.
            seq.num_computed = seq.num_tokens + accepted
            seq.draft = None
            out = self._emit(seq, result.token_ids[i], logprobs[i])
            # Emitted, not accepted + 1: a stop token or max_tokens inside the accepted draft
            # cuts the rest, and those tokens never reach the client.
            self.spec.record(num_draft, accepted, len(out.new_token_ids))
            outputs.append(out)
            if seq.finish_reason is None:
                self.pages.truncate(seq.table, seq.num_tokens)
                self.pages.commit_full_pages(seq.table, seq.all_token_ids, seq.num_computed)
        return outputs

    def _spec_logprobs(
        self,
        seqs: list[Sequence],
        token_ids: list[list[int]],
        logits: torch.Tensor,
        inp: SamplerInput,
        processed: torch.Tensor,
        row_starts: list[int],
    ) -> list[list[TokenLogprob] | None]:
        """Each accepted token's logprob at its own position's row (``logits``: the verified
        rows, drafts included, ``inp``'s masks describing them)."""
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        out: list[list[TokenLogprob] | None] = [None] * len(seqs)
        if not want:
            return out
        source = self.sampler.logprob_logits(logits, inp, processed)
        rows = [row_starts[i] + j for i in want for j in range(len(token_ids[i]))]
        flat = [t for i in want for t in token_ids[i]]
        params = [seqs[i].params for i in want for _ in token_ids[i]]
        lp = self.sampler.logprobs(
            source[rows], to_device(flat, torch.int64, source.device), params
        ).to_host()
        assert lp.logprobs is not None and lp.top_logprobs is not None
        k = 0
        for i in want:
            entries = []
            for t in token_ids[i]:
                entries.append(TokenLogprob(t, lp.logprobs[k], lp.top_logprobs[k]))
                k += 1
            out[i] = entries
        return out

    @staticmethod
    def _draft_masks(
        seqs: list[Sequence],
        drafts: list[Proposal],
        inp: SamplerInput,
        vocab: int,
        device: torch.device,
    ) -> None:
        """Grammar masks for every verified position of the constrained sequences: a draft
        token the grammar rejects is then rejected by verification, and the matcher is back
        where it was (the emitted tokens advance it in ``_emit``)."""
        if all(s.grammar is None for s in seqs):
            return
        from gpu.grammar import allocate_bitmask

        bitmask = allocate_bitmask(sum(len(d) + 1 for d in drafts), vocab)
        start = 0
        for seq, draft in zip(seqs, drafts, strict=True):
            if seq.grammar is not None:
                limited = seq.grammar.draft_masks(draft.token_ids, bitmask, start)
                inp.masked_rows.extend(start + j for j in limited)
            start += len(draft) + 1
        if inp.masked_rows:
            inp.token_bitmask = move(bitmask, device)

    def _sampler_input(self, seqs: list[Sequence]) -> SamplerInput:
        return SamplerInput(
            params=[s.params for s in seqs],
            prompt_token_ids=[s.prompt_token_ids for s in seqs],
            output_token_ids=[s.output_token_ids for s in seqs],
            generators=[s.generator for s in seqs],
            eos_token_ids=self.eos_ids,
        )

    def _emit(
        self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None
    ) -> StepOutput:
        """Append tokens up to the first that finishes the sequence; the rest are dropped."""
        reason = None
        for n, token in enumerate(tokens, start=1):
            seq.output_token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                tokens = tokens[:n]
                logprobs = logprobs[:n] if logprobs is not None else None
                break
        prompt_logprobs = None
        if seq.prompt_scoring is not None:
            prompt_logprobs = seq.prompt_scoring.result(seq.prompt_token_ids)
            seq.prompt_scoring = None
        embedding = None
        if seq.pooling is not None:
            embedding = seq.pooling.vector()
            seq.pooling = None
        output = StepOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            finish_reason=reason,
            prompt_tokens=len(seq.prompt_token_ids),
            output_tokens=len(seq.output_token_ids),
            cached_tokens=seq.num_cached_prompt_tokens,
            logprobs=logprobs,
            stop_token=reason is not None and self._is_stop_token(seq.params, tokens[-1]),
            prompt_logprobs=prompt_logprobs,
            embedding=embedding,
        )
        if reason is not None:
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = reason
            self.scheduler.remove(seq)
            del self.seqs[seq.request_id]
            if self.proposer is not None:
                self.proposer.release([seq.request_id])
        return output

    def _is_stop_token(self, params: SamplingParams, token: int) -> bool:
        return token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        )

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if self._is_stop_token(params, token):
            return FinishReason.STOP
        if params.allowed_token_ids and token not in params.allowed_set:
            # Sampled only where the row was left no token at all (the sampler's EOS then,
            # gpu.logits_filters.stop_dead_rows): nothing more can follow, ignore_eos or not.
            return FinishReason.STOP
        if seq.grammar is not None and (not seq.grammar.accept([token]) or seq.grammar.terminated):
            # Terminated: the document is complete, nothing may follow it. Not accepted cannot
            # happen (the mask allowed only grammar tokens); ending beats an invalid document.
            return FinishReason.STOP
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    # -- offline convenience ---------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion together; returns each one's output token ids."""
        per = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{next(self._offline_ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, per, strict=True):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self.seqs for rid in ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]
