"""Executor handlers and the step loop.

Incoming requests and aborts are buffered and applied on the event-loop thread between steps
(the engine is not thread-safe); ``engine.step()`` runs on a worker thread so NATS traffic keeps
flowing while the model computes. Each step's tokens go out as ONE ``StepTokens`` message per
detokenizer shard.

On SIGTERM the executor drains: it reports ``draining`` in its heartbeat (the scheduler sends it
nothing new) and finishes the sequences it holds before it exits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import torch

from common.messages import (
    AbortRequests,
    ErrorEvent,
    Heartbeat,
    SeqTokens,
    StepTokens,
    StreamStart,
    TokenizedRequest,
    TokenLogprobs,
)
from common.runtime import Service
from gpu.engine import Engine, EngineConfig, StepOutput
from gpu.gguf import resolve_model_path
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling import SamplingParams
from services.executor.config import ExecutorConfig

log = logging.getLogger("meshserve.executor")


def sampling_params(req: TokenizedRequest, eos_ids: frozenset[int]) -> SamplingParams:
    p = req.params
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        max_tokens=p.max_tokens,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
    )


class ExecutorService:
    def __init__(self, config: ExecutorConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.svc = Service("executor", config.mesh)
        self.subjects = config.mesh.subjects
        self.requests: dict[str, TokenizedRequest] = {}
        self.started: set[str] = set()
        self.pending_adds: list[TokenizedRequest] = []
        self.pending_aborts: set[str] = set()
        self.wake = asyncio.Event()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        self.draining = False

    async def start(self) -> None:
        await self.svc.connect()
        await self.svc.subscribe(
            self.subjects.executor_submit(self.config.executor_id), TokenizedRequest, self.on_submit
        )
        await self.svc.subscribe(self.subjects.abort, AbortRequests, self.on_abort)
        self.svc.spawn(self.step_loop(), "step-loop")
        self.svc.spawn(self.svc.every(self.config.heartbeat_s, self.heartbeat), "heartbeat")

    # -- handlers ---------------------------------------------------------------------------
    async def on_submit(self, req: TokenizedRequest) -> None:
        self.pending_adds.append(req)
        self.wake.set()

    async def on_abort(self, msg: AbortRequests) -> None:
        mine = [rid for rid in msg.request_ids if rid in self.requests]
        if mine or any(r.request_id in msg.request_ids for r in self.pending_adds):
            self.pending_aborts.update(msg.request_ids)
            self.wake.set()

    async def heartbeat(self) -> None:
        sched = self.engine.scheduler
        pending = sum(s.num_pending for s in sched.waiting) + sum(
            s.num_pending for s in sched.running
        )
        await self.svc.publish(
            self.subjects.executor_heartbeat,
            Heartbeat(
                executor_id=self.config.executor_id,
                running=len(sched.running),
                waiting=len(sched.waiting) + len(self.pending_adds),
                free_pages=self.engine.blocks.num_free,
                total_pages=self.engine.blocks.num_pages,
                page_size=self.config.page_size,
                max_num_seqs=self.config.max_num_seqs,
                pending_tokens=pending,
                draining=self.draining,
                sent_at=time.time(),
            ),
        )

    # -- the step loop ------------------------------------------------------------------------
    async def step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.apply_pending()
            if not self.engine.has_unfinished():
                if self.draining:
                    return
                self.wake.clear()
                await self.wake.wait()
                continue
            outputs = await loop.run_in_executor(self.worker, self.engine.step)
            await self.publish_outputs(outputs)

    async def apply_pending(self) -> None:
        adds, self.pending_adds = self.pending_adds, []
        aborts, self.pending_aborts = self.pending_aborts, set()
        for req in adds:
            if req.request_id in aborts:
                continue
            try:
                params = sampling_params(req, self.engine.eos_token_ids)
                self.engine.add_request(req.request_id, req.prompt_token_ids, params)
            except ValueError as exc:  # ModelError included: the request, not the executor
                await self.svc.publish(req.reply_to, ErrorEvent(req.request_id, 400, str(exc)))
                continue
            self.requests[req.request_id] = req
        for rid in aborts:
            if self.engine.abort(rid):
                self.forget(rid)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.started.discard(request_id)

    async def publish_outputs(self, outputs: list[StepOutput]) -> None:
        by_shard: dict[int, list[SeqTokens]] = defaultdict(list)
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None:
                continue
            start = None
            if out.request_id not in self.started:
                self.started.add(out.request_id)
                start = StreamStart(
                    stop=req.params.stop,
                    skip_special_tokens=req.params.skip_special_tokens,
                    prompt_tokens=out.prompt_tokens,
                    cached_tokens=out.cached_tokens,
                )
            logprobs = None
            if out.logprobs is not None:
                logprobs = [TokenLogprobs(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]
            by_shard[req.detok_shard % self.config.detok_shards].append(
                SeqTokens(
                    request_id=out.request_id,
                    reply_to=req.reply_to,
                    token_ids=out.new_token_ids,
                    finish_reason=out.finish_reason.value if out.finish_reason else None,
                    output_tokens=out.output_tokens,
                    start=start,
                    logprobs=logprobs,
                )
            )
            if out.finish_reason is not None:
                self.forget(out.request_id)
        for shard, seqs in by_shard.items():
            await self.svc.publish(
                self.subjects.detok(shard), StepTokens(self.config.executor_id, seqs)
            )

    async def drain(self) -> None:
        """Finish what we hold, then stop; the heartbeat says we take nothing new."""
        self.draining = True
        await self.heartbeat()
        self.wake.set()


def build_engine(config: ExecutorConfig) -> Engine:
    folder = resolve_model_path(config.model)
    device = torch.device(config.device)
    model = load_model(folder, device=device)
    runner = ModelRunner(model, num_pages=config.num_pages, page_size=config.page_size)
    engine_config = EngineConfig(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    from common.tokenizer import Tokenizer

    eos = Tokenizer.from_folder(folder).eos_token_ids
    return Engine(runner, engine_config, eos_token_ids=eos)
