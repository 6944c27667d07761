"""The scheduler's view of which executor holds which request (pure bookkeeping)."""

from __future__ import annotations

from common.wire.executor import TokenizedRequest
from common.wire.scheduler import Heartbeat
from common.wire.tokenizer import WireSamplingParams
from services.scheduler.inflight import Inflight


def req(rid: str) -> TokenizedRequest:
    return TokenizedRequest(rid, "inbox", WireSamplingParams(), [1, 2, 3], [], 0)


def hb(executor: str, ids: list[str]) -> Heartbeat:
    return Heartbeat(executor, len(ids), 0, 10, 10, 16, 8, 0, request_ids=ids)


def test_finished_requests_are_forgotten_and_a_dead_executor_gives_up_all_it_held():
    inflight = Inflight()
    for i, rid in enumerate(["a", "b", "c", "d"]):
        inflight.assign("e1" if rid != "d" else "e2", req(rid), rank=(0.0, i))
    inflight.observe(hb("e1", ["a", "b"]))  # c not received yet
    inflight.observe(hb("e2", ["d"]))
    inflight.observe(hb("e1", ["b", "c"]))  # a finished
    assert "a" not in inflight and len(inflight) == 3
    lost = inflight.take_executor("e1")
    assert sorted(a.request.request_id for a in lost) == ["b", "c"]
    assert {a.request.request_id: a.rank for a in lost}["c"] == (0.0, 2)  # keeps its place
    assert list(inflight.assignments) == ["d"]


def test_unseen_assignment_expires_when_executor_never_lists_it():
    inflight = Inflight(unseen_timeout_s=0.0)
    inflight.assign("e1", req("x"), rank=(0.0, 0))
    inflight.observe(hb("e1", []))  # rejected by the executor (it answered the client)
    assert not inflight.assignments
