"""Which executors serve a request, by role (pure: no NATS)."""

from __future__ import annotations

import dataclasses

from common.wire.executor import TokenizedRequest, WireGrammar
from common.wire.scheduler import Heartbeat
from services.scheduler.guests import GuestPlacement
from services.scheduler.pairing import Route, route
from services.scheduler.router import Router
from tests.test_routing import PROMPT, heartbeat, request


def beat(executor: str, role: str, free_pages: int = 1000, pending: int = 0) -> Heartbeat:
    return dataclasses.replace(
        heartbeat(executor, pending_tokens=pending), role=role, free_pages=free_pages
    )


def mesh(*beats: Heartbeat) -> Router:
    r = Router("kv", max_imbalance=64)
    r.recent.ttl_s = 0
    for hb in beats:
        r.observe(hb)
    return r


def test_a_pair_prefills_where_the_prefix_is_and_decodes_on_the_lightest():
    r = mesh(
        beat("p0", "prefill"),
        beat("p1", "prefill"),
        beat("d0", "decode", pending=800),
        beat("d1", "decode"),
        beat("m0", "mixed"),
    )
    assert route(r, request(PROMPT), {"p1": 40, "d0": 40}) == Route("d1", "p1")
    assert route(r, request(PROMPT), {"p0": 40}) == Route("d1", "p0")


def test_decode_executors_need_free_pages_for_the_prompt():
    r = mesh(beat("p0", "prefill"), beat("d0", "decode", free_pages=10), beat("d1", "decode"))
    assert route(r, request(PROMPT), {}) == Route("d1", "p0")  # 40 pages do not fit on d0
    full = mesh(beat("p0", "prefill"), beat("d0", "decode", free_pages=10))
    assert route(full, request(PROMPT), {}) is None  # it waits in the queue


def test_a_prompt_no_decode_executor_could_ever_hold_is_sent_to_be_refused():
    """Longer than every decode executor's whole pool (or its context): it waited for room
    that never comes, first in the queue, and everything behind it waited until its
    deadline; it now goes to the lightest, which answers with a 400 as a mixed one does."""
    small = dataclasses.replace(beat("d0", "decode", free_pages=30), total_pages=30)
    short = dataclasses.replace(beat("d1", "decode", pending=50), max_model_len=20 * 16)
    r = mesh(beat("p0", "prefill"), small, short)  # a 40-page prompt: neither can hold it
    assert route(r, request(PROMPT), {}) == Route("d0", "p0")  # the lightest
    # One that could hold it once it has room: the prompt waits for it, as before.
    r.observe(dataclasses.replace(beat("d2", "decode", free_pages=10), total_pages=1000))
    assert route(r, request(PROMPT), {}) is None
    r.observe(beat("d2", "decode", pending=500))
    assert route(r, request(PROMPT), {}) == Route("d2", "p0")  # not d1: its context is short


def test_migrated_requests_and_a_missing_prefill_pool_prefill_locally():
    r = mesh(beat("p0", "prefill"), beat("d0", "decode"))
    resumed = dataclasses.replace(request(PROMPT), output_token_ids=[5, 6])
    assert route(r, resumed, {}) == Route("d0")
    assert route(mesh(beat("d0", "decode")), request(PROMPT), {}) == Route("d0")


def test_without_decode_executors_mixed_and_prefill_ones_serve_alone():
    assert route(mesh(beat("m0", "mixed")), request(PROMPT), {}) == Route("m0")
    assert route(mesh(beat("p0", "prefill")), request(PROMPT), {}) == Route("p0")
    assert route(mesh(), request(PROMPT), {}) is None


def test_a_constrained_request_is_prefilled_where_it_decodes():
    # Its grammar's state after the first token would have to cross with the KV.
    r = mesh(beat("p0", "prefill"), beat("d0", "decode"))
    grammar = WireGrammar(key="k", ebnf='root ::= "a"')
    constrained = dataclasses.replace(request(PROMPT), grammar=grammar)
    assert route(r, constrained, {}) == Route("d0")
    assert route(r, request(PROMPT), {}) == Route("d0", "p0")


def test_a_short_uncached_prompt_is_prefilled_on_its_decode_executor():
    """Conditional disaggregation: below ``min_prompt_tokens`` uncached tokens the decode
    executor prefills the prompt itself; its cached pages there count as computed."""
    r = mesh(beat("p0", "prefill"), beat("d0", "decode"))
    n = len(PROMPT)
    assert route(r, request(PROMPT), {}, min_prompt_tokens=n + 1) == Route("d0")
    assert route(r, request(PROMPT), {}, min_prompt_tokens=n) == Route("d0", "p0")
    assert route(r, request(PROMPT), {}) == Route("d0", "p0")  # 0: every prompt moves
    page = r.executors["d0"].heartbeat.page_size
    cached = {"d0": 2}  # two pages of the prompt already on d0: fewer tokens to compute
    assert route(r, request(PROMPT), cached, min_prompt_tokens=n - 2 * page + 1) == Route("d0")
    assert route(r, request(PROMPT), cached, min_prompt_tokens=n - 2 * page) == Route("d0", "p0")


def full(executor: str, guests: int) -> Heartbeat:
    """A mixed executor of 4 slots holding 5 sequences (its scheduler's 25% slack), ``guests``
    of them spilled in from another region."""
    hb = dataclasses.replace(heartbeat(executor), running=4, waiting=1, max_num_seqs=4)
    return dataclasses.replace(hb, guests=guests)


def test_guests_on_a_full_executor_yield_their_room_to_own_requests_only():
    own, guest = request(PROMPT), dataclasses.replace(request(PROMPT, "g"), guest=True)
    r = mesh(full("m0", guests=2))
    assert route(r, own) == Route("m0")  # 5 held, 2 of them give their slots up: 3 < 5
    assert route(r, guest) is None  # a guest does not push another guest out
    assert route(r, guest, keep_free=1) is None
    assert route(mesh(full("m0", guests=0)), own) is None  # own sequences keep their slots


# Guests (requests spilled in from another region): guests.py.


def seqs(executor: str, running: int, role: str = "mixed", guests: int = 0) -> Heartbeat:
    """An executor of 4 sequence slots, ``running`` of them taken."""
    hb = dataclasses.replace(beat(executor, role), running=running, max_num_seqs=4)
    return dataclasses.replace(hb, guests=guests)


def least_load(*beats: Heartbeat) -> Router:
    r = Router("least-load")
    for hb in beats:
        r.observe(hb)
    return r


def guest(rid: str = "g") -> TokenizedRequest:
    return dataclasses.replace(request(PROMPT, rid), guest=True)


def test_guests_go_only_to_the_guest_executors_and_leave_the_reserve_executor_alone():
    # m2 is the lightest, but m0 and m1 already hold guests: with 1 executor in reserve, the
    # third executor takes none, however idle (without the policy it would be chosen).
    r = least_load(seqs("m0", 2), seqs("m1", 2), seqs("m2", 0))
    placement = GuestPlacement({"m0": 1, "m1": 1}, reserve_executors=1)
    assert route(r, guest(), {}, placement=placement) in (Route("m0"), Route("m1"))
    assert route(r, guest(), {}) == Route("m2")  # no reserve: the lightest
    # No guest anywhere yet: the guest executors are the ones with the most free slots.
    fresh = GuestPlacement({}, reserve_executors=1)
    r = least_load(seqs("m0", 3), seqs("m1", 1), seqs("m2", 0))
    assert fresh.guest_executors(r, ("mixed",)) == ["m1", "m2"]
    # Full guest executors: the guest waits (None) rather than take the reserve executor.
    r = least_load(seqs("m0", 4), seqs("m1", 4), seqs("m2", 0))
    assert route(r, guest(), {}, placement=placement) is None
    assert route(r, guest(), {}) == Route("m2")
    assert placement.spare_seqs(r, reserve_seqs=1) == 0  # nothing to report to other regions


def test_the_region_keeps_its_reserve_of_slots_once_counting_the_guest_free_executors_first():
    # --spill-reserve-seqs 1: m2 (taking no guests) has 4 free slots, so the guest executors
    # may fill theirs; the region keeps 1 free in all, not 1 on each guest executor.
    placement = GuestPlacement({"m0": 1, "m1": 1}, reserve_executors=1)
    r = least_load(seqs("m0", 3), seqs("m1", 3), seqs("m2", 0))
    assert placement.guest_room(r, 1, ("mixed",)) == 2  # m0's and m1's last slots
    assert placement.spare_seqs(r, reserve_seqs=1) == 2
    assert route(r, guest(), {}, placement=placement) in (Route("m0"), Route("m1"))
    assert placement.guest_room(r, 6, ("mixed",)) == 0  # 6 free in all: all kept
    assert placement.guest_room(r, 5, ("mixed",)) == 1
    r = least_load(seqs("m0", 3), seqs("m1", 3), seqs("m2", 4))  # m2 full: 2 free in all
    assert placement.guest_room(r, 1, ("mixed",)) == 1
    assert placement.guest_room(r, 2, ("mixed",)) == 0
    # No executor kept guest-free: the reserve is the region's, wherever its free slots are.
    spread = GuestPlacement({}, reserve_executors=0)
    r = least_load(seqs("m0", 3), seqs("m1", 3))
    assert spread.guest_room(r, 1, ("mixed",)) == 1  # (kept on each executor it would be 0)


def test_a_guest_leaves_each_prefill_executor_the_reserve_in_a_disaggregated_region():
    # d1 takes no guests and has free slots, so the decode side has room for the guest; the
    # one prefill executor has a single free slot, which the region's reserve keeps.
    r = least_load(seqs("p0", 3, "prefill"), seqs("d0", 1, "decode"), seqs("d1", 0, "decode"))
    placement = GuestPlacement({"d0": 1}, reserve_executors=1)
    assert route(r, guest(), {}, placement=placement, prefill_keep_free=1) is None
    assert route(r, guest(), {}, placement=placement) == Route("d0", "p0")
    assert route(r, request(PROMPT), {}, placement=placement) == Route("d1", "p0")


def test_a_region_with_no_more_executors_than_its_reserve_takes_no_guests():
    r = least_load(seqs("m0", 0))
    placement = GuestPlacement({}, reserve_executors=1)
    assert route(r, guest(), {}, placement=placement) is None
    assert placement.spare_seqs(r, reserve_seqs=0) == 0
    assert route(r, request(PROMPT), {}, placement=placement) == Route("m0")
    assert GuestPlacement({}, reserve_executors=0).spare_seqs(r, reserve_seqs=1) == 3


def test_own_requests_prefer_an_executor_holding_no_guests():
    # m0 and m1 are lighter but run guests (their steps keep going); m2 holds none.
    r = least_load(seqs("m0", 1, guests=1), seqs("m1", 1, guests=1), seqs("m2", 2))
    placement = GuestPlacement({"m0": 1, "m1": 1}, reserve_executors=1)
    assert route(r, request(PROMPT), {}, placement=placement) == Route("m2")
    assert route(r, request(PROMPT), {}) in (Route("m0"), Route("m1"))  # without: the lightest
    # m2's slots all taken: the request goes where a guest yields its slot at the next step,
    # not into m2's local queue until one of its sequences ends.
    r = least_load(seqs("m0", 4, guests=2), seqs("m1", 4, guests=3), seqs("m2", 4))
    assert route(r, request(PROMPT), {}, placement=placement) in (Route("m0"), Route("m1"))


def test_guest_executors_are_decode_executors_when_the_region_is_disaggregated():
    r = least_load(seqs("p0", 0, "prefill"), seqs("d0", 1, "decode"), seqs("d1", 0, "decode"))
    placement = GuestPlacement({"d0": 1}, reserve_executors=1)
    assert route(r, guest(), {}, placement=placement) == Route("d0", "p0")
    assert route(r, request(PROMPT), {}, placement=placement) == Route("d1", "p0")
    assert placement.spare_seqs(r, reserve_seqs=1) == 3  # d0's 3 free (d1's are the reserve)


def embedding(mode: str = "last") -> TokenizedRequest:
    req = request(PROMPT)
    return dataclasses.replace(req, params=dataclasses.replace(req.params, pooling=mode))


def test_an_embedding_runs_whole_on_a_prefill_executor():
    """It never decodes: no decode executor reserves for it; it waits for a prefill
    executor's room, and goes to a decode one only where no prefill executor serves it."""
    r = mesh(beat("p0", "prefill"), beat("p1", "prefill"), beat("d0", "decode"))
    assert route(r, embedding(), {"p1": 40}) == Route("p1")
    full = dataclasses.replace(beat("p0", "prefill"), running=64, waiting=64)
    busy = mesh(full, beat("d0", "decode"))
    assert route(busy, embedding(), {}) is None
    assert route(mesh(beat("d0", "decode")), embedding(), {}) == Route("d0")


def test_mean_pooling_and_prompt_logprobs_take_no_credit_for_cached_pages():
    """They compute every prompt position wherever they run: the lighter executor wins
    over the one holding the prefix (a last-token embedding still goes to the prefix)."""
    r = mesh(beat("m0", "mixed", pending=300), beat("m1", "mixed"))
    assert route(r, embedding("last"), {"m0": 40}) == Route("m0")
    assert route(r, embedding("mean"), {"m0": 40}) == Route("m1")
    scored = request(PROMPT)
    scored = dataclasses.replace(
        scored, params=dataclasses.replace(scored.params, prompt_logprobs=0)
    )
    assert route(r, scored, {"m0": 40}) == Route("m1")
