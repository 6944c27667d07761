"""The scheduler's queue rules without a model or a bus: priority order (vLLM's: lower runs
first), aging that bounds how long a request can be overtaken, aborts that arrive before
their request, and one id running once."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from common.config import MeshConfig
from common.metrics import counter_total
from common.wire.executor import AbortRequests, TokenizedRequest
from common.wire.gateway import ErrorEvent
from common.wire.scheduler import Heartbeat
from common.wire.tokenizer import WireSamplingParams
from services.scheduler.regions import Decision, RegionConfig
from services.scheduler.service import SchedulerService, SchedulerServiceConfig


def request(rid: str, priority: int = 0) -> TokenizedRequest:
    return TokenizedRequest(rid, "inbox", WireSamplingParams(), [3, 4, 5], [], 0, priority=priority)


def full(executor: str = "a") -> Heartbeat:
    """An executor with no room (so requests stay queued until a test frees it)."""
    return Heartbeat(executor, 8, 0, 0, 100, 16, 8, 0)


def room(executor: str = "a") -> Heartbeat:
    return Heartbeat(executor, 0, 0, 100, 100, 16, 1, 0)  # one slot: one request per beat


@pytest.fixture
def scheduler(monkeypatch):
    def make(region: str = "", **options) -> tuple[SchedulerService, list[str]]:
        mesh = MeshConfig(instance_id="t", region=region)
        sched = SchedulerService(SchedulerServiceConfig(mesh, **options))
        sent: list[str] = []

        async def publish(subject: str, message: object) -> None:
            if isinstance(message, TokenizedRequest):
                sent.append(message.request_id + " (guest)" * message.guest)

        monkeypatch.setattr(sched.svc, "publish", publish)
        sched.router.slack = 0.0  # an executor takes exactly max_num_seqs
        sched.router.observe(full())
        return sched, sent

    return make


async def drain(sched: SchedulerService, n: int) -> None:
    for _ in range(n):
        await sched.on_heartbeat(room())
        await sched.settled()


async def test_lower_priority_values_run_first_then_oldest_first(scheduler, monkeypatch):
    sched, sent = scheduler(priority_aging_s=100.0)
    for rid, priority in [("p5", 5), ("p0-old", 0), ("m3", -3), ("p0-new", 0)]:
        await sched.on_submit(request(rid, priority))
    await drain(sched, 4)
    assert sent == ["m3", "p0-old", "p0-new", "p5"]


async def test_aging_bounds_how_long_a_request_is_overtaken(scheduler, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("services.scheduler.service.time.monotonic", lambda: clock[0])
    sched, sent = scheduler(priority_aging_s=1.0)
    await sched.on_submit(request("patient", priority=2))  # worth 2 s of waiting
    for i in range(6):  # a steady stream of more urgent requests, 0.5 s apart
        clock[0] += 0.5
        await sched.on_submit(request(f"urgent-{i}"))
    await drain(sched, 7)
    # Those that arrived within 2 s after it go first; later ones wait behind it.
    assert sent.index("patient") == 3, sent


async def test_an_abort_before_the_request_is_queued_wins(scheduler):
    sched, sent = scheduler()
    await sched.on_abort(AbortRequests(["early"], "client disconnected"))
    await sched.on_submit(request("early"))
    await sched.on_submit(request("kept"))
    await drain(sched, 2)
    assert sent == ["kept"] and sched.queue == [] and not sched.queued


async def test_a_queued_request_aborted_anywhere_in_the_queue_is_dropped(scheduler):
    sched, sent = scheduler()
    for rid in ("a1", "a2", "a3"):
        await sched.on_submit(request(rid))
    await sched.on_abort(AbortRequests(["a2"], "client disconnected"))
    await sched.on_abort(AbortRequests(["a3"], "moved", executor_id="ex"))  # not an end
    await drain(sched, 3)
    assert sent == ["a1", "a3"]


async def test_one_request_id_is_queued_and_run_once(scheduler):
    sched, sent = scheduler()
    await sched.on_submit(request("x"))
    await sched.on_submit(request("x"))  # a replayed message while queued
    await drain(sched, 1)
    await sched.on_submit(request("x"))  # and while an executor holds it
    await drain(sched, 2)
    assert sent == ["x"]


def test_ended_ids_are_forgotten_after_their_ttl_and_bounded_in_number():
    from common.recent_ids import RecentIds

    now = [0.0]
    ended: RecentIds[str, bool] = RecentIds(ttl_s=10, max_size=3, clock=lambda: now[0])
    for rid in ("a", "b", "c", "d"):
        ended.add(rid, True)
    assert "a" not in ended and len(ended) == 3  # the oldest went first
    now[0] = 11
    assert "b" not in ended  # expired
    ended.add("e", True)
    ended.prune()
    assert len(ended) == 1 and "e" in ended


async def test_a_request_from_another_region_waits_behind_ours_and_leaves_the_reserve(
    scheduler,
):
    # Spilled in (a guest): queued after every request of this region's own clients, and sent
    # only to an executor that keeps --spill-reserve-seqs slots free after it, so a local
    # request arriving next still finds a slot.
    sched, sent = scheduler(regions=RegionConfig(spill_reserve_seqs=1, spill_reserve_executors=0))
    await sched.on_spilled(request("guest-1"))
    await sched.on_submit(request("local-1"))
    await sched.on_spilled(request("guest-2"))
    await sched.on_heartbeat(Heartbeat("a", 2, 0, 100, 100, 16, 4, 0))  # 2 of 4 slots free
    await sched.settled()
    assert sent == ["local-1"]  # the last free slot is the reserve: no guest takes it
    await sched.on_submit(request("local-2"))
    assert sent == ["local-1", "local-2"]  # a local one may
    await sched.on_heartbeat(Heartbeat("a", 1, 0, 100, 100, 16, 4, 0))  # 3 free
    await sched.settled()
    # Marked as guests for the executor (which preempts them for a local request, if full).
    assert sent == ["local-1", "local-2", "guest-1 (guest)", "guest-2 (guest)"]
    await sched.on_submit(request("local-3"))
    assert sent[-1] == "local-3" and not sched.queue


async def test_guests_do_not_count_in_the_wait_our_own_clients_are_estimated(scheduler):
    # A local request's spill decision rests on this estimate: guests queued here (behind
    # every local request, yielding their executor slots to them) are no wait of its.
    sched, sent = scheduler(regions=RegionConfig(spill_reserve_seqs=1, spill_reserve_executors=0))
    await sched.on_heartbeat(Heartbeat("a", 1, 0, 100, 100, 16, 4, 0, guests=1))
    await sched.settled()
    for i in range(3):
        await sched.on_spilled(request(f"guest-{i}"))
    assert sent == ["guest-0 (guest)", "guest-1 (guest)"] and len(sched.queue) == 1
    assert sched.home_load().queue_ms == 0.0  # room for a local one: it starts now
    await sched.on_heartbeat(Heartbeat("a", 4, 1, 100, 100, 16, 4, 0, guests=0))  # own only
    await sched.settled()
    assert sched.home_load().queue_ms > 0.0


async def test_guests_keep_to_one_executor_of_two_and_our_own_requests_to_the_other(scheduler):
    # --spill-reserve-executors 1 (the default) of 2: guests go to one executor only, the
    # region reports only that one's slots as spare (b's free slots are the reserve of 1),
    # and its own requests go to the other.
    sched, sent = scheduler(regions=RegionConfig(spill_reserve_seqs=1))
    await sched.on_heartbeat(Heartbeat("a", 0, 0, 100, 100, 16, 4, 0))
    await sched.settled()
    await sched.on_heartbeat(Heartbeat("b", 0, 0, 100, 100, 16, 4, 0))
    await sched.settled()
    assert sched.home_load().spare_seqs == 4  # one executor's 4 slots (not 4 + 4 - 1)
    for i in range(5):
        await sched.on_spilled(request(f"guest-{i}"))
    assert sent == [f"guest-{i} (guest)" for i in range(4)]
    assert {a.executor_id for a in sched.inflight.assignments.values()} == {"a"}
    assert len(sched.queue) == 1  # guest-4 waits: a is full, b takes no guests
    await sched.on_submit(request("local-0"))
    assert sent[-1] == "local-0" and sched.inflight.assignments["local-0"].executor_id == "b"


async def test_guests_go_back_once_no_executor_may_take_one_for_a_heartbeat_timeout(
    scheduler, monkeypatch
):
    # One live executor and --spill-reserve-executors 1: no executor here may take a guest.
    # (The clock starts at the real one's reading: the fixture's executor was seen by that.)
    clock = [time.monotonic()]
    monkeypatch.setattr("services.scheduler.service.time.monotonic", lambda: clock[0])
    regions = RegionConfig(peer_regions=("us-east",), spill_reserve_executors=1)
    sched, _ = scheduler(regions=regions)
    published: list[object] = []

    async def publish(subject: str, message: object) -> None:
        published.append(message)

    monkeypatch.setattr(sched.svc, "publish", publish)
    await sched.on_spilled(request("g1"))
    await sched.on_submit(request("own"))
    await sched.return_guests()  # the first sweep that finds none: not yet (a restart?)
    clock[0] += 1.9
    await sched.return_guests()
    assert sorted(r.request_id for _, r in sched.queue) == ["g1", "own"]
    clock[0] += 0.2  # past the heartbeat timeout (2 s)
    await sched.return_guests()
    assert [r.request_id for _, r in sched.queue] == ["own"]  # own requests wait here
    errors = [(m.request_id, m.status, m.code) for m in published if isinstance(m, ErrorEvent)]
    assert errors == [("g1", 503, "region_unavailable")]  # resumable: its gateway continues it
    aborts = [m.request_ids for m in published if isinstance(m, AbortRequests)]
    assert aborts == [["g1"]]  # every stage here forgets it
    assert counter_total(sched.spill.returned_total) == 1
    assert sched.home_load().guest_executors == 0  # what the other regions are told

    # A second executor: one of the two may take guests, and a guest stays however long.
    sched.router.observe(full("b"))
    await sched.on_spilled(request("g2"))
    for _ in range(3):
        clock[0] += 2.5
        for executor in ("a", "b"):  # both live: they keep beating
            sched.router.observe(full(executor))
        await sched.return_guests()
    assert sorted(r.request_id for _, r in sched.queue) == ["g2", "own"]
    assert sched.home_load().guest_executors == 1


async def test_a_guest_is_not_sent_on_when_this_region_has_no_executor(scheduler, monkeypatch):
    """With no live executor here, queued requests of our own clients go to another region;
    a guest stays (``return_guests`` sends it home after a grace), where it went back to its
    home region, each then holding it as spilled to the other: its abort circled."""
    clock = [time.monotonic()]
    monkeypatch.setattr("services.scheduler.service.time.monotonic", lambda: clock[0])
    sched, _ = scheduler("eu-west", regions=RegionConfig(peer_regions=("us-east",)))
    await sched.on_spilled(request("guest"))
    await sched.on_submit(request("own"))
    clock[0] += 2.5  # executor "a" is silent past the heartbeat timeout
    assert sched.home_load().live_executors == 0
    monkeypatch.setattr(
        sched.spill, "decide", lambda req, cached=0: Decision("us-east", "no-local-executor", 0.0)
    )
    spilled: list[str] = []

    async def send(req: TokenizedRequest, decision: Decision) -> None:
        spilled.append(req.request_id)

    monkeypatch.setattr(sched.spill, "send", send)
    await sched.spill_queued()
    assert spilled == ["own"]
    assert [r.request_id for _, r in sched.queue] == ["guest"]


async def test_the_record_of_where_requests_were_spilled_is_pruned(scheduler):
    """``RegionSpill.prune`` was never called: expired entries stayed until the size cap."""
    sched, _ = scheduler()
    now = [0.0]
    sched.spill.spilled.clock = lambda: now[0]
    sched.spill.spilled.add("r", "eu-west")
    await sched.sweep()
    assert len(sched.spill.spilled) == 1
    now[0] += sched.spill.spilled.ttl_s + 1
    await sched.sweep()
    assert len(sched.spill.spilled) == 0


async def test_a_silent_regions_round_trip_is_no_longer_shown(scheduler, monkeypatch):
    """The gauge kept the last good round trip of a region that stopped answering."""
    from common.runtime import NoAnswer
    from common.wire.scheduler import RegionStatus
    from services.scheduler.regions import RegionConfig

    sched, _ = scheduler("us-east", regions=RegionConfig(peer_regions=("eu-west",)))
    answer: list[RegionStatus | None] = [RegionStatus("eu-west", 1, 0.0, 4, 1)]

    async def request(subject, message, kind, timeout):
        if answer[0] is None:
            raise NoAnswer("partitioned")
        return answer[0]

    monkeypatch.setattr(sched.svc, "request", request)
    rtt = "meshserve:scheduler_region_rtt_seconds"
    await sched.spill.ask("eu-west")
    assert sched.svc.registry.get_sample_value(rtt, {"region": "eu-west"}) is not None
    answer[0] = None
    await sched.spill.ask("eu-west")  # one missed answer: the report still counts
    assert sched.svc.registry.get_sample_value(rtt, {"region": "eu-west"}) is not None
    sched.spill.peers["eu-west"].at -= sched.spill.config.stale_s + 1
    await sched.spill.ask("eu-west")  # stale now: no round trip to show
    assert sched.svc.registry.get_sample_value(rtt, {"region": "eu-west"}) is None


async def test_an_abort_for_a_request_it_does_not_hold_goes_to_every_peer_region(
    scheduler, monkeypatch
):
    """A scheduler that restarted (or whose record expired) while its request ran in another
    region as a guest did not forward the client's abort: the guest ran to its end for
    nobody. An abort it holds, or that came from a peer, goes nowhere else."""
    regions = RegionConfig(peer_regions=("eu-west", "ap-south"))
    sched, _ = scheduler("us-east", regions=regions)
    sent: list[tuple[str, list[str], str]] = []

    async def publish(subject: str, message: object) -> None:
        if isinstance(message, AbortRequests):
            sent.append((subject, sorted(message.request_ids), message.from_region))

    monkeypatch.setattr(sched.svc, "publish", publish)
    await sched.on_submit(request("queued-here"))
    sched.spill.spilled.add("spilled", "eu-west")
    await sched.on_abort(AbortRequests(["queued-here", "spilled", "forgotten"], "client left"))
    assert sorted(sent) == [
        ("mesh.v1.ap-south.requests.abort", ["forgotten"], "us-east"),
        ("mesh.v1.eu-west.requests.abort", ["forgotten", "spilled"], "us-east"),
    ]
    sent.clear()
    await sched.on_abort(AbortRequests(["forgotten"], "client left"))  # ended already
    await sched.on_abort(AbortRequests(["other"], "client left", from_region="eu-west"))
    await sched.on_abort(AbortRequests(["moved"], "moved", executor_id="a"))
    assert sent == []
    # Its own ending of a guest (no executor here may take it) is not sent on either.
    await sched.on_spilled(request("guest"))
    await sched.end_everywhere(["guest"], "returned to its region")
    await sched.on_abort(AbortRequests(["guest"], "returned to its region"))
    assert [s for s in sent if s[0] != "mesh.v1.us-east.requests.abort"] == []


async def test_the_watchdogs_question_about_an_unknown_request_is_asked_of_every_peer(
    scheduler, monkeypatch
):
    """After a restart the scheduler answered "unknown" for its guests in another region: the
    gateway failed streams that were only queued there. A peer's own question is answered
    from what the peer holds, never asked further (two regions would ask each other)."""
    from common.wire.scheduler import RequestStatusQuery, RequestStatusReply

    regions = RegionConfig(peer_regions=("eu-west", "ap-south"))
    sched, _ = scheduler("us-east", regions=regions)
    holds = {
        "mesh.v1.eu-west.scheduler.status": ["guest-west"],
        "mesh.v1.ap-south.scheduler.status": [],
    }
    asked: list[tuple[str, list[str], str]] = []

    async def ask(subject, message, kind, timeout):
        asked.append((subject, message.request_ids, message.from_region))
        return RequestStatusReply([r for r in holds[subject] if r in message.request_ids])

    monkeypatch.setattr(sched.svc, "request", ask)
    from common.wire.scheduler import RegionStatus
    from services.scheduler.spill import PeerReport

    for region in ("eu-west", "ap-south", "silent"):  # the last stopped answering our polls
        at = time.monotonic() - (60 if region == "silent" else 0)
        sched.spill.peers[region] = PeerReport(RegionStatus(region, 1, 0.0, 4, 1), 5.0, at)
    await sched.on_submit(request("mine"))
    reply = await sched.on_status(RequestStatusQuery(["mine", "guest-west", "lost"]))
    assert sorted(reply.known) == ["guest-west", "mine"]
    assert sorted(asked) == [
        ("mesh.v1.ap-south.scheduler.status", ["guest-west", "lost"], "us-east"),
        ("mesh.v1.eu-west.scheduler.status", ["guest-west", "lost"], "us-east"),
    ]
    assert sched.spill.spilled.get("guest-west") == "eu-west"  # its abort goes there now
    asked.clear()
    reply = await sched.on_status(RequestStatusQuery(["mine", "lost"], from_region="eu-west"))
    assert reply.known == ["mine"] and asked == []


async def test_a_heartbeat_is_not_held_behind_a_dispatch_waiting_on_the_index(
    scheduler, monkeypatch
):
    """Heartbeats are handled one after another; one that waited for the dispatch lock while
    a pass asked a slow index about each queued request held every later one, and the sweep
    took executors that were beating for lost. It now leaves the running pass to go again."""
    from common.page_hash import page_hashes
    from common.wire.prefix_index import IndexMatchReply

    sched, sent = scheduler(router="kv")
    sched.router.observe(room("a"))
    sched.router.observe(room("b"))  # two candidates: the index is asked
    answer = asyncio.Event()
    asked: list[str] = []

    async def slow_index(subject, message, kind, timeout):
        asked.append(message.request_id)
        await answer.wait()
        return IndexMatchReply({}, 4)

    monkeypatch.setattr(sched.svc, "request", slow_index)
    tokens = list(range(64))
    queued = TokenizedRequest(
        "q", "inbox", WireSamplingParams(), tokens, page_hashes(tokens, 16), 0
    )
    submit = asyncio.create_task(sched.on_submit(queued))
    for _ in range(100):
        if asked:
            break
        await asyncio.sleep(0)
    assert asked == ["q"]
    beat = dataclasses.replace(room("a"), sent_at=time.time())
    await asyncio.wait_for(sched.on_heartbeat(beat), 1)  # not behind the index
    assert sched.router.executors["a"].heartbeat is beat and sched.dispatch_again
    answer.set()
    await submit
    assert sent == ["q"]

    # A heartbeat that finds room and requests queued does not run the pass itself either.
    answer.clear()
    sched.push((time.monotonic(), 99), dataclasses.replace(queued, request_id="q2"))
    sched.router.observe(room("a"))
    await asyncio.wait_for(sched.on_heartbeat(room("b")), 1)  # both have room: index asked
    for _ in range(100):
        if "q2" in asked:
            break
        await asyncio.sleep(0)
    assert "q2" in asked and sent == ["q"]  # the pass waits on the index; the handler did not
    answer.set()
    await sched.settled()
    assert sent == ["q", "q2"]


# --------------------------------------------------------------------------- LoRA adapters


def lora_request(rid: str, lora: str = "qv", **kw) -> TokenizedRequest:
    return dataclasses.replace(request(rid), lora=lora, **kw)


def adapter_beat(executor: str, free: bool, loras: list[str] | None, role: str = "mixed"):
    running = 0 if free else 8
    return Heartbeat(
        executor, running, 0, 100 if free else 0, 100, 16, 8, 0, role=role, loras=loras
    )


async def test_an_adapter_request_without_room_lets_the_rest_go_to_other_executors(
    scheduler, monkeypatch
):
    """The only executor with the adapter is full: the base requests behind it go to the
    other executor (never to that one: the adapter's request keeps its place there), and the
    adapter's request goes once its executor has room."""
    sched, sent = scheduler()
    sched.router.observe(adapter_beat("a", True, []))  # (replaces the fixture's full "a")
    sched.router.observe(adapter_beat("b", False, ["qv"]))
    await sched.on_submit(lora_request("l1"))
    await sched.on_submit(request("b1"))
    await sched.on_submit(request("b2"))
    await sched.settled()
    assert sent == ["b1", "b2"]
    assert {sched.inflight.assignments[r].executor_id for r in sent} == {"a"}
    sched.router.observe(adapter_beat("b", True, ["qv"]))
    await sched.dispatch()
    assert sent[-1] == "l1" and sched.inflight.assignments["l1"].executor_id == "b"
    assert sched.router.held_back == set()


async def test_an_adapter_nobody_serves_fails_after_a_heartbeat_timeout(scheduler, monkeypatch):
    """Not at once (its executor may be restarting, or its first heartbeat on the way), and
    not if it comes back in time; after that a 404; an executor that says nothing of its
    adapters (older than the field) is taken as serving any."""
    clock = [time.monotonic()]
    monkeypatch.setattr("services.scheduler.service.time.monotonic", lambda: clock[0])
    sched, sent = scheduler()
    published: list[object] = []

    async def publish(subject: str, message: object) -> None:
        published.append(message)
        if isinstance(message, TokenizedRequest):
            sent.append(message.request_id)

    monkeypatch.setattr(sched.svc, "publish", publish)
    sched.router.observe(adapter_beat("a", True, []))
    await sched.on_submit(lora_request("l1"))
    await sched.on_submit(request("b1"))
    await sched.settled()
    assert sent == ["b1"] and [r.request_id for _, r in sched.queue] == ["l1"]
    clock[0] += 1.0
    sched.router.observe(adapter_beat("a", True, []))
    sched.router.observe(adapter_beat("b", True, ["qv"]))  # back in time
    await sched.dispatch()
    assert sent == ["b1", "l1"]
    sched.router.forget("b")
    await sched.on_submit(lora_request("l2"))
    await sched.settled()
    clock[0] += 2.1
    sched.router.observe(adapter_beat("a", True, []))  # (its heartbeats go on meanwhile)
    await sched.dispatch()
    errors = [(m.request_id, m.status, m.code) for m in published if isinstance(m, ErrorEvent)]
    assert errors == [("l2", 404, "model_not_found")] and not sched.queue
    sched.router.observe(adapter_beat("old", True, None))
    await sched.on_submit(lora_request("l3"))
    await sched.settled()
    assert sent[-1] == "l3"


async def test_an_adapter_no_prefill_executor_serves_is_prefilled_where_it_decodes(scheduler):
    sched, sent = scheduler()
    sched.router.forget("a")
    sched.router.observe(adapter_beat("dec", True, ["qv"], role="decode"))
    sched.router.observe(adapter_beat("pre", True, [], role="prefill"))
    long_prompt = list(range(3, 300))
    await sched.on_submit(lora_request("l1", prompt_token_ids=long_prompt))
    await sched.on_submit(request("b1"))
    await sched.settled()
    assert sorted(sent) == ["b1", "l1"]
    routed = sched.inflight.assignments["l1"]
    assert routed.executor_id == "dec" and routed.request.prefill_executor == ""
