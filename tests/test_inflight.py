"""The scheduler's view of which executor holds which request (pure bookkeeping)."""

from __future__ import annotations

from common.messages import Heartbeat, SamplingSpec, TokenizedRequest
from services.scheduler.inflight import Inflight


def req(rid: str) -> TokenizedRequest:
    return TokenizedRequest(rid, "inbox", SamplingSpec(), [1, 2, 3], [], 0)


def hb(executor: str, ids: list[str], started: list[str]) -> Heartbeat:
    return Heartbeat(executor, len(ids), 0, 10, 10, 16, 8, 0, request_ids=ids, started_ids=started)


def test_finished_requests_are_forgotten_and_dead_executors_split_their_work():
    inflight = Inflight()
    for i, rid in enumerate(["a", "b", "c", "d"]):
        inflight.assign("e1" if rid != "d" else "e2", req(rid), order=i)
    inflight.observe(hb("e1", ["a", "b"], ["a"]))  # c not received yet
    inflight.observe(hb("e2", ["d"], ["d"]))
    inflight.observe(hb("e1", ["b", "c"], ["b"]))  # a finished; b now streaming
    assert "a" not in inflight.assignments
    retry, failed = inflight.take_executor("e1")
    assert [a.request.request_id for a in retry] == ["c"]  # never streamed: re-route
    assert [a.request.request_id for a in failed] == ["b"]  # streaming: fail clearly
    assert retry[0].order == 2  # keeps its place in the global queue
    assert list(inflight.assignments) == ["d"]


def test_unseen_assignment_expires_when_executor_never_lists_it():
    inflight = Inflight(unseen_timeout_s=0.0)
    inflight.assign("e1", req("x"), order=0)
    inflight.observe(hb("e1", [], []))  # rejected by the executor (it answered the client)
    assert not inflight.assignments
