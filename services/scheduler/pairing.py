"""Which executor(s) serve a request, by the executors' roles (pure; no NATS).

- Mixed executors (the default role) prefill and decode; the router picks one (``router.py``).
- With decode executors live, requests go to them. A request also gets a prefill executor
  when one is live, it has nothing generated yet (a migrated request, which has, is
  prefilled locally) and no grammar constrains it (that one is prefilled locally too): the
  prefill executor computes the prompt and the first token, and writes the KV into pages
  the decode executor reserved (disaggregation). The prefill side is
  chosen as a mixed executor is (cached overlap and load: only it computes the prompt); the
  decode side by load, then by free pages, among those whose free pages hold the prompt.
- Prefill executors take a request alone (as mixed ones) only when no decode executor lives,
  or when it is an embedding (it never decodes: nothing for a decode executor to reserve).
- A prompt shorter than ``min_prompt_tokens`` once its cached pages on the decode executor
  are counted out is prefilled there (vLLM's and Dynamo's conditional disaggregation): a
  few dozen tokens cost the decode batch less than a hop to the prefill executor and a KV
  transfer whose fixed cost outweighs its bytes.
- Guests (requests spilled in from another region) go only to the region's guest executors,
  and its own requests prefer executors holding no guests (``guests.py``); that applies to
  the pool a request lives on (decode executors, or mixed ones), not to the prefill side.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.wire.executor import TokenizedRequest
from services.scheduler.guests import DECODE_POOL, MIXED_POOL, GuestPlacement
from services.scheduler.router import Router


@dataclass(frozen=True)
class Route:
    executor: str  # where the request lives (and decodes)
    prefill: str = ""  # where its prompt is computed, when not there


def route(
    router: Router,
    req: TokenizedRequest,
    overlaps: dict[str, int] | None = None,
    keep_free: int = 0,
    min_prompt_tokens: int = 0,
    placement: GuestPlacement | None = None,
    prefill_keep_free: int = 0,
) -> Route | None:
    """Where ``req`` goes now, or None to keep it queued (no executor of its pool has room).
    ``keep_free``: slots each chosen executor must still have free beyond this request (a
    request spilled in from another region leaves this region's reserve alone); the guests an
    executor holds do not count against a request of the region's own (they yield to it).
    ``min_prompt_tokens``: shorter uncached prompts are prefilled on the decode executor.
    ``placement``: which executors guests may go to and own requests prefer (``guests.py``).
    ``prefill_keep_free``: as ``keep_free``, on the prefill executor of a disaggregated route
    (a guest leaves each one the region's reserve: its prompts queue nowhere else)."""
    live = router.live_roles()
    if "decode" not in live:
        among = pool_candidates(router, req, MIXED_POOL, keep_free, placement)
        executor = router.pick(req, overlaps, among)
        return Route(executor) if executor else None
    if req.params.pooling and "prefill" in live and router.serving(req.lora, ("prefill",)):
        # An embedding never decodes: a prefill executor runs it whole, no decode executor
        # reserves pages or a slot for it
        among = pool_candidates(
            router, req, ("prefill",), max(keep_free, prefill_keep_free), placement
        )
        executor = router.pick(req, overlaps, among)
        return Route(executor) if executor else None
    decode = pick_decode(router, req, keep_free, placement)
    if decode is None:
        return None
    if "prefill" not in live or req.output_token_ids or req.grammar is not None:
        # A constrained request is prefilled where it decodes: its grammar's state after the
        # first token would have to cross to the decode side with the KV.
        return Route(decode)
    cached = (overlaps or {}).get(decode, 0) * router.executors[decode].heartbeat.page_size
    if len(req.prompt_token_ids) - cached < min_prompt_tokens:
        return Route(decode)
    if req.lora and not router.serving(req.lora, ("prefill",)):
        return Route(decode)  # (no prefill executor has its adapter: prefilled where it decodes)
    prefill_free = max(keep_free, prefill_keep_free)
    prefill = router.pick(
        req, overlaps, router.candidates(("prefill",), prefill_free, req.guest, req.lora)
    )
    return Route(decode, prefill) if prefill else None


def pool_candidates(
    router: Router,
    req: TokenizedRequest,
    pool: tuple[str, ...],
    keep_free: int,
    placement: GuestPlacement | None,
) -> list[str]:
    """The executors of ``pool`` with room for ``req`` that the guest placement allows it."""
    among = router.candidates(pool, keep_free, req.guest, req.lora)
    return (placement or GuestPlacement()).among(router, req, among, pool)


def pick_decode(
    router: Router,
    req: TokenizedRequest,
    keep_free: int = 0,
    placement: GuestPlacement | None = None,
) -> str | None:
    """The lightest decode executor whose free pages hold the prompt (and a token more).

    A prompt none of them could ever hold (longer than its whole pool or its context) goes
    to the lightest anyway, which refuses it with a 400, as a mixed executor does: waiting
    for room that never comes held the queue behind it until its deadline."""
    need = len(req.prompt_token_ids) + len(req.output_token_ids)
    among = pool_candidates(router, req, DECODE_POOL, keep_free, placement)
    fits, never = [], []
    for e in among:
        hb = router.executors[e].heartbeat
        if hb.total_pages * hb.page_size <= need or 0 < hb.max_model_len <= need:
            never.append(e)
        elif hb.free_pages * hb.page_size > need:
            fits.append(e)
    if among and len(never) == len(among):
        fits = among
    if not fits:
        return None
    return min(
        fits,
        key=lambda e: (router.executors[e].load, -router.executors[e].heartbeat.free_pages),
    )
