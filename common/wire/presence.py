"""Presence: what every service instance announces (``presence.<service>``) and the probe that
asks for an announcement now (``presence_probe``).

Watchers (``Service.watch_presence``: the gateway, the scheduler) receive ``Presence``; every
service's runtime receives ``PresenceProbe``.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.wire.codec import MAX_PAGE_SIZE, Message, id_ok, page_size_ok, require, time_ok

MAX_SHARDS = 1024  # detokenizer shards


@dataclass(frozen=True)
class Presence(Message):
    """An "I am alive" from one service instance, sent about once a second by its runtime
    (``common/runtime.py``) on ``presence.<service>``, and at once when a watcher probes.

    ``draining``: it is shutting down and should not be counted on. The optional facts are
    the ones other stages must agree with: a detokenizer's ``shard``; a tokenizer's
    ``page_size`` (it hashes prompt pages with it; executors must page their KV cache the same
    way or cache-aware routing finds nothing) and ``detok_shards`` (how many detokenizer
    shards requests are spread over).
    """

    service: str
    instance_id: str
    draining: bool = False
    sent_at: float = 0.0
    shard: int | None = None
    page_size: int | None = None
    detok_shards: int | None = None
    # A tokenizer's: the tool-call format of its chat template (``common.tool_formats``); the
    # gateway parses tool calls out of the text with it.
    tool_format: str | None = None
    # A tokenizer's backlog: the arrival time (the gateway's wall clock) of the request it
    # is working on while more wait behind it, or None when it has nothing waiting. A request
    # that arrived after it may still be queued there (the gateway's watchdog waits for it).
    behind_since: float | None = None

    def __post_init__(self) -> None:
        # The service name is one subject token of ``presence.<service>``: no dots.
        service_ok = len(self.service) <= 64 and id_ok(self.service) and "." not in self.service
        shard_ok = self.shard is None or 0 <= self.shard < MAX_SHARDS
        page_ok = self.page_size is None or page_size_ok(self.page_size)
        shards_ok = self.detok_shards is None or 1 <= self.detok_shards <= MAX_SHARDS
        require(
            "Presence",
            {
                "service must be a short subject token": service_ok,
                "instance_id must be a non-empty subject-safe id": id_ok(self.instance_id),
                "sent_at must be a finite time >= 0": time_ok(self.sent_at),
                f"shard must be within 0..{MAX_SHARDS - 1}": shard_ok,
                f"page_size must be within 1..{MAX_PAGE_SIZE}": page_ok,
                f"detok_shards must be within 1..{MAX_SHARDS}": shards_ok,
            },
        )


@dataclass(frozen=True)
class PresenceProbe(Message):
    """A watcher that just (re)connected asks every service to announce itself now, so its
    view of the mesh is complete at once rather than after a full announcement interval."""

    asker: str = ""
