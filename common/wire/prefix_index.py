"""What the prefix index receives: executors' prefix-cache changes (``kv.events.<id>``, through
JetStream) and the scheduler's match queries (``index.match``, request/reply).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.wire.codec import Message


@dataclass(frozen=True)
class KVEventBatch(Message):
    """Changes to one executor's prefix cache, in order; one batch per executor step.

    ``seq`` counts an executor's batches from 1 since it started; a gap tells the index it
    missed changes. Apply in this order: ``cleared`` (forget everything the executor held),
    then ``evicted``, then ``stored`` (``(page_hash, parent_hash)``, chained hashes from
    ``common.page_hash``; the parent of a prompt's first page is ``ROOT_HASH``). A batch with
    ``cleared`` followed by stored pages is a full snapshot of the executor's cache.
    """

    executor_id: str
    seq: int
    cleared: bool = False
    evicted: list[int] = field(default_factory=list)
    stored: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class IndexMatchRequest(Message):
    """Scheduler -> index: how much of this prompt does each executor hold?"""

    page_hashes: list[int]
    request_id: str = ""


@dataclass(frozen=True)
class IndexMatchReply(Message):
    """Pages of the prompt's prefix (leading page hashes) each executor holds; absent = 0."""

    overlaps: dict[str, int]
    num_executors: int = 0
