"""Request resumption: a choice whose tokens were lost in transit continues as a new request.

Core NATS delivers at most once: a server of a cluster that dies takes the messages in flight
on its connections with it, so a stream can lose a step (the detokenizer sees the gap in the
token count, the gateway the gap in the deltas' numbers), its start (the detokenizer never saw
it), or the whole request (the watchdog finds it unknown to the scheduler). Such a choice is
not failed: the gateway submits a continuation, what vLLM does when it preempts a sequence by
recomputation, here across the mesh. The continuation is the original request with the tokens
its client already received as ``output_token_ids`` (from ``TextDelta.token_ids``): the
executor prefills prompt + those tokens, counts them towards ``max_tokens`` and the penalties,
and a seeded request's generator skips the draws they took; the new detokenizer stream replays
them without sending their text. So the client's stream goes on with neither a duplicated nor a
missing token, and its usage counts the original prompt and every generated token once.

What a continuation reproduces: greedy output exactly; a seeded sampled request's exactly when
it decodes without speculation (``gpu.sampling``: one draw per step from its own generator;
with speculative decoding the draws are spent per verify step, so it is another valid sample);
an unseeded sampled one is a new sample from the same distribution.

Only errors that mean "lost on the way" are resumed (``RESUMABLE``); a 4xx, a model error or a
timeout is the request's own, and resubmitting would fail the same way. Each choice is resumed
at most ``max_resumes`` times and only before its deadline, so a mesh that keeps losing it
still answers with the error.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from common.wire.tokenizer import GenerateRequest

if TYPE_CHECKING:
    from services.gateway.streams import RequestStream

# 503 codes whose request was lost in transit (the stage that answers them names the loss):
# a gap in the tokens (detokenizer) or deltas (gateway), a start the detokenizer never saw
# (executor, ``stream_lost``), a step the executor could not publish, a request no stage
# holds any more (watchdog), the gateway's own connection lost (one NATS server), and a
# spilled request sent back by a region left without an executor for it (its scheduler).
RESUMABLE = frozenset(
    {
        "stream_gap",
        "stream_lost",
        "delivery_failed",
        "request_lost",
        "mesh_unavailable",
        "region_unavailable",
    }
)


def resumable(status: int, code: str | None) -> bool:
    return status == 503 and code in RESUMABLE


def continuation(
    original: GenerateRequest, choice: int, delivered: list[int], attempt: int
) -> GenerateRequest:
    """Choice ``choice`` of ``original`` as a request of its own that continues after the
    ``delivered`` tokens, under a fresh id (``<choice id>-r<attempt>``; its one choice is that
    plus ``-0``): every stage has forgotten the lost id or drops what still comes for it.

    Choice ``i`` samples with seed + i (``GenerateRequest.choices``): the continuation carries
    that seed as its own. ``max_tokens`` stays the original: the engine counts the delivered
    tokens towards it. The deadline and arrival time stay the original's: the client waits no
    longer than it would have, and the scheduler's queue order sees an old request.
    """
    choice_id, params = original.choices()[choice]
    return replace(
        original,
        request_id=f"{choice_id}-r{attempt}",
        params=params,
        n=1,
        output_token_ids=list(delivered),
    )


class Resubmitter(Protocol):
    """What a stream needs to resume a choice (``MeshClient``): route the continuation's ids to
    it, publish it, and withdraw the lost attempt. Raises ``RequestError`` when the mesh
    cannot take it now; the stream then fails with the original error."""

    async def resubmit(
        self, stream: RequestStream, request: GenerateRequest, lost_id: str
    ) -> None: ...
