"""Pick an executor for a request from the executors' load and prefix-cache overlap (pure; no
NATS).

Policies (``--router``):

- ``kv``, cache-aware, as NVIDIA Dynamo's KV router scores workers::

      cost(e) = overlap_weight * (request pages not cached on e) + load(e)

  lowest wins. A page cached on ``e`` is a page ``e`` need not prefill, so the first term is
  the prefill work this request would add there; ``load(e)`` is the work ``e`` already has
  (below), both in pages of tokens to compute. The default weight is 2, not 1: a hit also
  spares the mesh a second copy of the prefix (which would evict some other prefix), and load
  reports lag (a request that just finished still counts as queued work until the executor's
  next heartbeat), so at 1 a request often leaves the executor holding its prefix for a tie.
  Load-imbalance guard: an executor whose load exceeds the least-loaded executor's by more than
  ``max_imbalance`` pages is skipped however much of the prompt it holds, so a hot prefix
  spills onto a second executor instead of queueing everything behind the first.
- ``least-load``: lowest ``load(e)``.
- ``round-robin``: in turn.

``load(e)`` = the executor's running and waiting tokens still to compute (prompt tokens to
prefill plus one per decoding sequence, from its heartbeat, plus the uncached tokens sent to it
since) in pages, plus one per sequence.

Overlap is what the prefix index reports, or, if larger, what this router sent to ``e`` in the
last ``recent_ttl_s`` seconds: those pages are being prefilled there but not reported yet, and
without this a burst sharing a new prefix would spread over every executor before the first
request's pages reach the index.

Executors are only offered work while they have room (late binding): a request waits in the
scheduler's global queue, where priority and fairness are decided, rather than in an
executor's local queue.

An executor whose KV page size is not the mesh's (the tokenizers' announced ``page_size``,
else the other executors'; ``common/mesh_facts.py``) is refused work with an error in the log
when it appears: the prompt page hashes would never match its cache, so routing would silently
lose every cache hit there.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.mesh_facts import page_size_refusals
from common.wire.executor import TokenizedRequest
from common.wire.presence import Presence
from common.wire.scheduler import Heartbeat

log = logging.getLogger("meshserve.scheduler")

POLICIES = ("kv", "least-load", "round-robin")


@dataclass
class ExecutorState:
    heartbeat: Heartbeat
    last_seen: float = field(default_factory=time.monotonic)
    assigned_since_heartbeat: int = 0
    assigned_tokens_since_heartbeat: int = 0  # tokens it must compute for them (uncached)

    @property
    def sequences(self) -> int:
        hb = self.heartbeat
        return hb.running + hb.waiting + self.assigned_since_heartbeat

    @property
    def pending_pages(self) -> float:
        tokens = self.heartbeat.pending_tokens + self.assigned_tokens_since_heartbeat
        return tokens / self.heartbeat.page_size

    @property
    def load(self) -> float:
        return self.pending_pages + self.sequences

    @property
    def free_seqs(self) -> int:
        """Sequence slots of its batch that nothing holds or is about to."""
        return max(0, self.heartbeat.max_num_seqs - self.sequences)

    def has_room(self, slack: float, yielding: int = 0) -> bool:
        """``yielding``: sequences there that give their slots up to this request."""
        held = self.sequences - yielding
        return not self.heartbeat.draining and held < self.heartbeat.max_num_seqs * (1 + slack)


@dataclass
class RecentRoutes:
    """The page hashes of requests routed in the last ``ttl_s`` seconds, per executor."""

    ttl_s: float = 10.0
    expiry: dict[int, dict[str, float]] = field(default_factory=dict)  # hash -> executor -> t
    _pruned_at: float = 0.0

    def add(self, executor: str, page_hashes: Sequence[int], now: float) -> None:
        until = now + self.ttl_s
        for page_hash in page_hashes:
            self.expiry.setdefault(page_hash, {})[executor] = until
        if now - self._pruned_at > 1.0:
            self.prune(now)

    def overlap(self, executor: str, page_hashes: Sequence[int], now: float) -> int:
        """Leading pages of ``page_hashes`` recently routed to ``executor``."""
        for depth, page_hash in enumerate(page_hashes):
            if self.expiry.get(page_hash, {}).get(executor, 0.0) < now:
                return depth
        return len(page_hashes)

    def forget(self, executor: str) -> None:
        """A process gone (dead, or restarted under its id with an empty cache)."""
        self._drop(lambda e, until: e == executor)

    def prune(self, now: float) -> None:
        self._pruned_at = now
        self._drop(lambda e, until: until < now)

    def _drop(self, gone: Callable[[str, float], bool]) -> None:
        for page_hash, executors in list(self.expiry.items()):
            for executor, until in list(executors.items()):
                if gone(executor, until):
                    del executors[executor]
            if not executors:
                del self.expiry[page_hash]


@dataclass
class Router:
    policy: str = "least-load"
    overlap_weight: float = 2.0  # see the module docstring
    max_imbalance: float = 256.0  # pages of load; see the module docstring
    heartbeat_timeout_s: float = 2.0
    slack: float = 0.25  # how far past max_num_seqs an executor's local queue may grow
    tokenizer_ttl_s: float = 3.0  # a tokenizer's announced page size counts for this long
    executors: dict[str, ExecutorState] = field(default_factory=dict)
    # tokenizer instance -> (announced page size, monotonic time of its last announcement)
    tokenizers: dict[str, tuple[int, float]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # executor -> why it gets no work
    # Within one dispatch pass: the executors of adapter requests that found no room there,
    # which the requests queued after them may not take (``SchedulerService._dispatch``).
    held_back: set[str] = field(default_factory=set)
    _tokenizers_disagree: list[int] = field(default_factory=list)  # logged once per change
    recent: RecentRoutes = field(default_factory=RecentRoutes)
    _rr: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown router policy {self.policy!r}; choose from {POLICIES}")
        if self.overlap_weight < 0 or self.max_imbalance < 0:
            raise ValueError("overlap_weight and max_imbalance must be >= 0")

    def observe(self, hb: Heartbeat) -> None:
        state = self.executors.get(hb.executor_id)
        if state is None:
            self.executors[hb.executor_id] = ExecutorState(hb, last_seen=time.monotonic())
        else:
            state.heartbeat = hb
            state.last_seen = time.monotonic()
            state.assigned_since_heartbeat = 0
            state.assigned_tokens_since_heartbeat = 0
        self.check_page_sizes()

    def observe_presence(self, presence: Presence) -> bool:
        """Learn the tokenizers' page size; True when that changed which executors are refused."""
        if presence.service != "tokenizer" or presence.page_size is None:
            return False
        before = dict(self.refused)
        now = time.monotonic()
        # Forget tokenizers long gone (each restart is a new instance); this one is the newest.
        self.tokenizers = {
            tid: entry
            for tid, entry in self.tokenizers.items()
            if now - entry[1] <= self.tokenizer_ttl_s
        }
        self.tokenizers[presence.instance_id] = (presence.page_size, now)
        self.check_page_sizes()
        return self.refused != before

    def tokenizer_page_sizes(self, now: float | None = None) -> list[int]:
        """The page sizes live tokenizers announced; with none live, the last one heard (a
        restarting tokenizer does not make the mesh forget its page size)."""
        now = time.monotonic() if now is None else now
        live = [
            size for size, seen in self.tokenizers.values() if now - seen <= self.tokenizer_ttl_s
        ]
        if live or not self.tokenizers:
            return live
        return [max(self.tokenizers.values(), key=lambda entry: entry[1])[0]]

    def check_page_sizes(self) -> None:
        """Refuse executors whose page size is not the mesh's; log each change once."""
        sizes = self.tokenizer_page_sizes()
        disagreeing = sorted(set(sizes)) if len(set(sizes)) > 1 else []
        if disagreeing and disagreeing != self._tokenizers_disagree:
            log.error("scheduler: tokenizers announce different page sizes %s", disagreeing)
        self._tokenizers_disagree = disagreeing
        refused = page_size_refusals(
            sizes, {eid: s.heartbeat.page_size for eid, s in self.executors.items()}
        )
        for executor, reason in refused.items():
            if self.refused.get(executor) != reason:
                log.error("scheduler: %s; refusing to route to it", reason)
        for executor in self.refused.keys() - refused.keys():
            if executor in self.executors:
                log.info("scheduler: executor %s now pages like the mesh; routing to it", executor)
        self.refused = refused

    def restarted(self, hb: Heartbeat) -> bool:
        """Is this heartbeat from a new process under a known executor's id?"""
        state = self.executors.get(hb.executor_id)
        return state is not None and state.heartbeat.incarnation != hb.incarnation

    def alive(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [
            eid
            for eid, s in self.executors.items()
            if now - s.last_seen <= self.heartbeat_timeout_s
        ]

    def forget(self, executor_id: str) -> ExecutorState:
        """Drop an executor's process: its state, and the prefixes routed to it lately (a
        restarted one under the same id holds none of them)."""
        self.recent.forget(executor_id)
        return self.executors.pop(executor_id)

    def forget_dead(self, now: float | None = None) -> dict[str, str]:
        """Forget the executors that went silent: {executor id: its incarnation}."""
        living = set(self.alive(now))
        dead = {
            eid: s.heartbeat.incarnation for eid, s in self.executors.items() if eid not in living
        }
        for eid in dead:
            self.forget(eid)
        if dead:
            self.check_page_sizes()  # the majority page size may have left with them
        return dead

    def candidates(
        self,
        roles: Sequence[str] | None = None,
        keep_free: int = 0,
        guest: bool = False,
        lora: str = "",
    ) -> list[str]:
        """Live executors with room now (of these roles; serving LoRA adapter ``lora``, if
        one is named), in a stable order; never a refused one. ``keep_free`` > 0: only those
        with more than that many sequence slots free (a request from another region must
        leave this region's reserve alone). A ``guest``
        needs a free slot (never the slack: it would wait in the executor's queue, where a
        spare slot in another region may be); unless the request is itself a guest, the
        guests an executor holds do not take its room: they yield their slots to it
        (``Heartbeat.guests``)."""
        return sorted(
            e
            for e in self.alive()
            if e not in self.refused
            and self.executors[e].has_room(
                self.slack, 0 if guest else self.executors[e].heartbeat.guests
            )
            and ((keep_free == 0 and not guest) or self.executors[e].free_seqs > keep_free)
            and (roles is None or self.executors[e].heartbeat.role in roles)
            and self.executors[e].heartbeat.serves(lora)
            and e not in self.held_back
        )

    def pool(self, roles: Sequence[str] | None = None, lora: str = "") -> list[str]:
        """The live executors (of these roles; serving ``lora``, if named) that may get work,
        room or not (draining ones take none)."""
        return [e for e in self.serving(lora, roles) if not self.executors[e].heartbeat.draining]

    def serving(self, lora: str, roles: Sequence[str] | None = None) -> list[str]:
        """The live executors (of these roles) that serve adapter ``lora``, draining ones
        too (they are back, or replaced, soon: no reason to fail its requests)."""
        return sorted(
            e
            for e in self.alive()
            if e not in self.refused
            and (roles is None or self.executors[e].heartbeat.role in roles)
            and self.executors[e].heartbeat.serves(lora)
        )

    def live_roles(self) -> set[str]:
        """The roles of the live executors that may get work (room or not)."""
        return {self.executors[e].heartbeat.role for e in self.alive() if e not in self.refused}

    @property
    def wants_overlaps(self) -> bool:
        return self.policy == "kv"

    def overlap(self, executor: str, req: TokenizedRequest, reported: dict[str, int]) -> int:
        if req.params.every_prompt_position:  # (no cached page spares it any work)
            return 0
        recent = self.recent.overlap(executor, req.page_hashes, time.monotonic())
        return max(reported.get(executor, 0), recent)

    def cost(self, state: ExecutorState, req: TokenizedRequest, overlap_pages: int) -> float:
        request_pages = -(-len(req.prompt_token_ids) // state.heartbeat.page_size)
        uncached = max(0, request_pages - overlap_pages)
        return self.overlap_weight * uncached + state.load

    def pick(
        self,
        req: TokenizedRequest,
        overlaps: dict[str, int] | None = None,
        among: list[str] | None = None,
    ) -> str | None:
        """The executor to send ``req`` to now, or None if none has room (it keeps waiting).

        ``overlaps``: pages of the prompt's prefix each executor holds (the index's answer).
        ``among``: the candidates to choose from (default: every one with room).
        """
        candidates = self.candidates() if among is None else among
        if not candidates:
            return None
        # Ties go to the executors in turn, not always to the first name: equal executors then
        # share new prefixes (and round-robin is all ties).
        turn = next(self._rr)
        rank = {e: (i - turn) % len(candidates) for i, e in enumerate(candidates)}
        if self.policy == "round-robin":
            return min(candidates, key=rank.__getitem__)
        if self.policy == "least-load":
            return min(candidates, key=lambda e: (self.executors[e].load, rank[e]))
        lightest = min(self.executors[e].load for e in candidates)
        within = [e for e in candidates if self.executors[e].load <= lightest + self.max_imbalance]
        reported = overlaps or {}
        return min(
            within,
            key=lambda e: (
                self.cost(self.executors[e], req, self.overlap(e, req, reported)),
                rank[e],
            ),
        )

    def assigned(
        self,
        executor_id: str,
        req: TokenizedRequest,
        overlaps: dict[str, int] | None = None,
        decode_only: bool = False,
    ) -> None:
        """Count ``req`` in the executor's load until its next heartbeat; ``decode_only``: a
        decode executor that receives the prompt's KV from a prefill executor."""
        state = self.executors[executor_id]
        if decode_only:
            state.assigned_since_heartbeat += 1
            state.assigned_tokens_since_heartbeat += 1
            return
        cached = 0
        if self.policy == "kv":
            cached = self.overlap(executor_id, req, overlaps or {}) * state.heartbeat.page_size
            self.recent.add(executor_id, req.page_hashes, time.monotonic())
        state.assigned_since_heartbeat += 1
        state.assigned_tokens_since_heartbeat += max(0, len(req.prompt_token_ids) - cached)
