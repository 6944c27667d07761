"""Speculator handlers: answer ``speculator.propose`` with draft tokens from a draft model.

Any number of replicas in the ``speculator`` queue group. A replica keeps each sequence's draft
KV cache between calls (``gpu.proposers.DraftModelProposer``) and extends it incrementally;
a call for a sequence it does not hold (another replica served it before, or it was evicted)
is still answered, after a prefill. So several replicas may hold one sequence: every replica
hears ``speculator.release`` (no queue group) and frees the finished ones it holds. The
model runs on one worker thread, so NATS traffic keeps flowing while it computes and calls
are served one at a time.

On SIGTERM it just drains: a proposal is an optimisation, and an executor that gets no answer
decodes without drafts.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from common.config import MeshConfig, device_setting, page_size_setting
from common.runtime import Service
from common.settings import parse, setting
from common.wire.speculator import DraftRelease, ProposeReply, ProposeRequest
from gpu.gguf import resolve_model_path
from gpu.loader import load_model
from gpu.proposers import DraftModelProposer
from gpu.runner import ModelRunner
from gpu.spec_decode import DraftRequest, Proposal
from services.speculator.wire import draft_request, draft_tokens

log = logging.getLogger("meshserve.speculator")


@dataclass(frozen=True)
class SpeculatorConfig:
    mesh: MeshConfig
    draft_model: str = setting(help="the draft model: a Hugging Face folder or a .gguf file")
    device: str = device_setting()
    page_size: int = page_size_setting()
    kv_cache_tokens: int = setting(
        65536,
        "the draft model's KV cache, in tokens (all sequences it holds)",
        env="MESHSERVE_DRAFT_KV_CACHE_TOKENS",
    )
    top_n: int = setting(
        32,
        "support of a sampled draft token's distribution sent to the executor",
        env="MESHSERVE_DRAFT_TOP_N",
    )
    max_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.kv_cache_tokens < self.page_size or self.top_n < 1:
            raise ValueError("kv_cache_tokens must hold a page and top_n must be >= 1")


def parse_args(argv: list[str] | None = None) -> SpeculatorConfig:
    return parse(SpeculatorConfig, argv, "python -m services.speculator")


def build_proposer(config: SpeculatorConfig) -> DraftModelProposer:
    folder = resolve_model_path(config.draft_model)
    model = load_model(folder, device=torch.device(config.device))
    runner = ModelRunner(model, config.kv_cache_tokens // config.page_size, config.page_size)
    return DraftModelProposer(runner, config.top_n, config.max_batched_tokens)


class SpeculatorService:
    def __init__(
        self,
        config: SpeculatorConfig,
        proposer: DraftModelProposer,
        worker: ThreadPoolExecutor | None = None,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.svc = Service("speculator", config.mesh)
        # The thread that built the draft model, when given: all torch work on one thread (one
        # OpenMP team; see services/executor/service.py).
        self.worker = worker or ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")

    async def start(self) -> None:
        await self.svc.connect()
        await self.svc.serve(
            self.svc.subjects.speculator_propose,
            ProposeRequest,
            self.on_propose,
            queue="speculator",
        )
        await self.svc.subscribe(
            self.svc.subjects.speculator_release, DraftRelease, self.on_release
        )

    async def on_release(self, msg: DraftRelease) -> None:
        loop = asyncio.get_running_loop()  # on the worker: the proposer's state is its own
        await loop.run_in_executor(self.worker, self.proposer.release, msg.request_ids)

    async def on_propose(self, req: ProposeRequest) -> ProposeReply:
        requests = []
        vocab = self.proposer.runner.config.vocab_size
        for seq in req.seqs:
            try:
                request = draft_request(seq)
            except ValueError as exc:
                log.warning("speculator: skipping %s: %s", seq.request_id, exc)
                continue
            if all(0 <= t < vocab for t in seq.token_ids):  # else: not this draft's tokenizer
                requests.append(request)
        loop = asyncio.get_running_loop()
        proposals = await loop.run_in_executor(self.worker, self._propose, req.released, requests)
        return ProposeReply(
            [draft_tokens(rid, p) for rid, p in proposals.items()], self.config.mesh.instance_id
        )

    def _propose(self, released: list[str], requests: list[DraftRequest]) -> dict[str, Proposal]:
        self.proposer.release(released)
        return self.proposer.propose(requests) if requests else {}
