"""The continuous-batching engine: add requests any time, abort any time, ``step()`` until done.

One step reads top to bottom: schedule -> build the batch -> forward -> sample -> postprocess.
No NATS here; the executor service drives ``step()`` off its event loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from gpu.attention.metadata import SeqChunk
from gpu.block_manager import BlockManager, KVEvent
from gpu.config import ModelError
from gpu.runner import ModelRunner
from gpu.sampling import Sampler, SamplerInput, SamplingParams, make_generator
from gpu.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from gpu.sequence import FinishReason, SeqStatus, Sequence


@dataclass(frozen=True)
class EngineConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs)


@dataclass(frozen=True)
class TokenLogprob:
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


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.runner = runner
        self.config = config or EngineConfig()
        self.blocks = BlockManager(
            runner.kv.spec.num_pages, runner.page_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.config.scheduler, self.blocks)
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(eos_token_ids or runner.config.eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self.num_steps = 0
        self._offline_ids = itertools.count()

    @property
    def max_seq_len(self) -> int:
        """A sequence never grows past the context length or what the KV pool holds."""
        return min(self.runner.max_model_len, self.runner.kv.spec.num_tokens)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Queue a request; raises ``ModelError``/``ValueError`` naming what is wrong with it."""
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ModelError("the prompt is empty")
        self.runner.check_prompt(prompt_token_ids)
        if len(prompt_token_ids) >= self.max_seq_len:
            raise ModelError(
                f"prompt has {len(prompt_token_ids)} tokens; at most {self.max_seq_len - 1} fit "
                "with room for one output token"
            )
        seq = Sequence(request_id, list(prompt_token_ids), params)
        seq.generator = make_generator(params, self.runner.device)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages; False if it is unknown or already done."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = FinishReason.ABORT
        return True

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def drain_kv_events(self) -> list[KVEvent]:
        return self.blocks.drain_events()

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        logits = self._forward(plan)
        return self._postprocess(plan, logits)

    def _forward(self, plan: SchedulerOutput) -> torch.Tensor:
        chunks = []
        tokens: list[list[int]] = []
        for item in plan.scheduled:
            seq = item.seq
            chunks.append(SeqChunk(tuple(seq.table.pages), seq.num_computed, item.num_new))
            start = seq.num_computed
            tokens.append(seq.all_token_ids[start : start + item.num_new])
        return self.runner.execute(chunks, tokens)

    def _postprocess(self, plan: SchedulerOutput, logits: torch.Tensor) -> list[StepOutput]:
        # Only sequences that caught up with their target sample; a prompt chunk that is not
        # the last one just advances num_computed.
        rows = []
        for row, item in enumerate(plan.scheduled):
            seq = item.seq
            seq.num_computed += item.num_new
            self.blocks.commit_full_pages(seq.table, seq.all_token_ids, seq.num_computed)
            if seq.num_pending == 0:
                rows.append(row)
        if not rows:
            return []
        seqs = [plan.scheduled[r].seq for r in rows]
        sampled = self.sampler(
            logits[rows] if len(rows) < logits.shape[0] else logits,
            SamplerInput(
                params=[s.params for s in seqs],
                prompt_token_ids=[s.prompt_token_ids for s in seqs],
                output_token_ids=[s.output_token_ids for s in seqs],
                generators=[s.generator for s in seqs],
            ),
        )
        token_ids = sampled.token_ids.tolist()
        outputs = []
        for i, seq in enumerate(seqs):
            token = token_ids[i]
            seq.output_token_ids.append(token)
            reason = self._finish_reason(seq, token)
            logprobs = None
            if seq.params.logprobs is not None and sampled.logprobs is not None:
                top = sampled.top_logprobs[i] if sampled.top_logprobs else []
                logprobs = [TokenLogprob(token, float(sampled.logprobs[i]), top)]
            outputs.append(
                StepOutput(
                    request_id=seq.request_id,
                    new_token_ids=[token],
                    finish_reason=reason,
                    prompt_tokens=len(seq.prompt_token_ids),
                    output_tokens=len(seq.output_token_ids),
                    cached_tokens=seq.num_cached_prompt_tokens,
                    logprobs=logprobs,
                )
            )
            if reason is not None:
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = reason
                self.scheduler.remove(seq)
                del self.seqs[seq.request_id]
        self.num_steps += 1
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
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
