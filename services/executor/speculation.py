"""The executor's client of the speculator service.

How the executor and the speculator meet: ``engine.step()`` runs on a worker thread and must
not wait on the network, so the step loop asks before each step. Between steps (the engine is
idle, on the event-loop thread) it takes ``engine.draft_requests()`` -- the sequences that will
decode next, each with its adaptive draft length -- sends them in ONE ``ProposeRequest`` to
``speculator.propose`` (queue group: any replica), awaits the ``ProposeReply`` for at most
``timeout_s``, hands the drafts to ``engine.set_drafts`` and then runs the step, which
verifies them in the same forward pass as everything else. The sequences that finished since
are published first to every replica (``speculator.release``): any replica may have served
a call for one and holds its draft KV. No answer in time (no speculator,
a slow or failed one) means this step decodes without drafts, and the proposer is skipped for
``backoff_s`` so a dead speculator costs one timeout, not one per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

from common.runtime import NoAnswer, Service
from common.wire.speculator import DraftRelease, ProposeReply, ProposeRequest
from common.wire.tokenizer import WireSamplingParams
from gpu.spec_decode import DraftRequest, Proposal
from services.speculator.wire import draft_seq, proposal

log = logging.getLogger("meshserve.executor")


class RemoteProposer:
    def __init__(self, svc: Service, timeout_s: float, backoff_s: float = 5.0) -> None:
        self.svc = svc
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.released: list[str] = []
        self.backoff_until = 0.0

    def release(self, request_ids: Iterable[str]) -> None:
        """Published before the next call, so the speculators free those sequences' drafts."""
        self.released.extend(request_ids)

    async def publish_released(self) -> None:
        if not self.released:
            return
        released, self.released = DraftRelease(self.released), []
        try:
            await self.svc.publish(self.svc.subjects.speculator_release, released)
        except Exception as exc:  # the replicas' LRU frees them in time
            log.warning("executor: could not tell the speculators what finished: %s", exc)

    async def propose(
        self, requests: list[DraftRequest], sampling: Mapping[str, WireSamplingParams]
    ) -> dict[str, Proposal]:
        await self.publish_released()
        if not requests or time.monotonic() < self.backoff_until:
            return {}
        message = ProposeRequest(
            [draft_seq(r, sampling[r.request_id]) for r in requests if r.request_id in sampling]
        )
        try:
            reply = await self.svc.request(
                self.svc.subjects.speculator_propose, message, ProposeReply, self.timeout_s
            )
        except NoAnswer as exc:
            log.warning(
                "executor: no draft from the speculator (%s); decoding without drafts for %.0f s",
                exc,
                self.backoff_s,
            )
            self.backoff_until = time.monotonic() + self.backoff_s
            return {}
        drafts = {}
        for tokens in reply.drafts:
            try:
                drafts[tokens.request_id] = proposal(tokens)
            except ValueError as exc:
                log.warning("executor: ignoring a bad draft for %s: %s", tokens.request_id, exc)
        return drafts
