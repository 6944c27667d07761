"""What the scheduler receives: executor heartbeats (``executor.heartbeat``) and the gateway's
status queries (``scheduler.status``, request/reply).

The gateway (health) and the prefix index (which executors are alive) also read heartbeats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.wire.codec import MAX_PAGE_SIZE, Message, id_ok, page_size_ok, require, time_ok


@dataclass(frozen=True)
class Heartbeat(Message):
    """An executor's load, sent periodically; the scheduler routes by it."""

    executor_id: str
    running: int
    waiting: int
    free_pages: int
    total_pages: int
    page_size: int
    max_num_seqs: int
    pending_tokens: int  # prompt tokens still to prefill plus one per running decode
    draining: bool = False
    sent_at: float = 0.0
    # Which requests the executor holds: the scheduler learns from it which have finished,
    # and which to move elsewhere if the executor dies.
    request_ids: list[str] = field(default_factory=list)
    # Random per process start: a restarted executor under the same id is a new incarnation,
    # and the scheduler moves whatever the previous one held at once.
    incarnation: str = ""
    # The longest sequence (prompt + output) it can hold: the model's context or its KV pool,
    # whichever is less. The gateway checks its own --max-model-len against it.
    max_model_len: int = 0
    # mixed (prefill and decode), prefill or decode (disaggregated; common.wire.executor.ROLES)
    role: str = "mixed"
    # Of the requests it holds, those spilled in from another region: each gives its slot up
    # to a request of this region's own clients (``gpu/scheduler.py``), so the scheduler does
    # not count them against one.
    guests: int = 0
    # The LoRA adapters it serves (its --lora-modules names): a request naming one goes only
    # to executors that have it, and the gateway accepts the names any executor serves. None:
    # not said (an executor older than the field), taken as serving any.
    loras: list[str] | None = None

    def serves(self, lora: str) -> bool:
        """Whether a request on adapter ``lora`` ("" : the base model) may come here."""
        return not lora or self.loras is None or lora in self.loras

    def __post_init__(self) -> None:
        # Only values no working executor sends: a rejected heartbeat makes the executor look
        # silent, and after the scheduler's timeout its requests are re-routed or failed.
        pages_ok = 0 <= self.free_pages <= self.total_pages
        require(
            "Heartbeat",
            {
                "executor_id must be a non-empty subject-safe id": id_ok(self.executor_id),
                "running must be >= 0": self.running >= 0,
                "loras must be non-empty names": self.loras is None or all(self.loras),
                "waiting must be >= 0": self.waiting >= 0,
                "total_pages must be >= 1": self.total_pages >= 1,
                "free_pages must be within 0..total_pages": pages_ok,
                f"page_size must be within 1..{MAX_PAGE_SIZE}": page_size_ok(self.page_size),
                "max_num_seqs must be >= 1": self.max_num_seqs >= 1,
                "pending_tokens must be >= 0": self.pending_tokens >= 0,
                "sent_at must be a finite time >= 0": time_ok(self.sent_at),
                "request_ids must be non-empty strings": all(self.request_ids),
                "role must be mixed, prefill or decode": self.role
                in ("mixed", "prefill", "decode"),
            },
        )


@dataclass(frozen=True)
class RequestStatusQuery(Message):
    """The gateway has heard nothing of these requests for a while: are they still alive?

    ``from_region``: set when a scheduler forwards the question to another region's; that one
    answers from what it holds itself and never asks further (two regions would ask each other
    in a loop about a request neither holds)."""

    request_ids: list[str]
    from_region: str = ""


@dataclass(frozen=True)
class RequestStatusReply(Message):
    """The ids the scheduler holds (queued, or routed to an executor that is alive)."""

    known: list[str]


@dataclass(frozen=True)
class RegionStatusQuery(Message):
    """A scheduler of region ``region`` asks another region's scheduler for its load (request/
    reply on ``scheduler.region_status``); the round trip is the inter-region RTT it counts."""

    region: str


@dataclass(frozen=True)
class RegionStatus(Message):
    """A region's load as its scheduler sees it (``services/scheduler/regions.py``)."""

    region: str
    live_executors: int
    queue_ms: float
    spare_seqs: int = 0  # slots free beyond its reserve for its own clients
    # executors that may take a guest now (``services/scheduler/guests.py``); 0 from a sender
    # that predates the field: it is then not counted on for guests
    guest_executors: int = 0

    def __post_init__(self) -> None:
        require(
            "RegionStatus",
            {
                "region must be a non-empty subject-safe id": id_ok(self.region),
                "live_executors must be >= 0": self.live_executors >= 0,
                "queue_ms must be >= 0": self.queue_ms >= 0,
                "guest_executors must be >= 0": self.guest_executors >= 0,
            },
        )
