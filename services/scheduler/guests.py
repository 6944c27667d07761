"""Which executors take guests (requests spilled in from another region), and which executors
the region's own requests prefer (pure; no NATS).

Why: a request that reaches an executor while a step runs waits for that step to end before
its own first step. Guests keep an executor stepping: with them on every executor of a region,
nearly every arrival of the region's own clients finds a step in progress and waits half a
step on average (``docs/performance.md``, two regions), which no slot policy on that executor
removes. So:

- guests go only to the *guest executors* of their pool: at most ``live - reserve_executors``
  of the live executors (``--spill-reserve-executors``), so at least that many hold none;
- the region's own requests go first to an executor that holds no guests and has a free
  sequence slot; only when none has do they go to a guest executor, where a guest yields its
  slot to them (``Heartbeat.guests``, ``gpu/scheduler.py``). Among the preferred ones the
  router's policy (cache overlap, load) decides as usual. While no executor holds a guest,
  routing is exactly the router's.

Which executors are guest executors: those already holding guests (most first), then those
with the most free slots, up to the allowed number. The choice is sticky (an executor stays a
guest executor while it holds guests) and follows deaths and restarts (only live executors
count), with no executor named in configuration.

The pool is where a guest lives: the decode executors when the region runs disaggregated
(the prefill side holds a guest only for its prompt), else the mixed and prefill ones.
``held`` counts the guests the scheduler dispatched to each executor that have not finished
(``Inflight``), not the executor's heartbeat: a guest just sent counts at once, before the
executor's next report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from common.wire.executor import TokenizedRequest
from services.scheduler.router import Router

MIXED_POOL = ("mixed", "prefill")
DECODE_POOL = ("decode",)


def guest_pool(router: Router) -> tuple[str, ...]:
    """The roles of the executors guests live on."""
    return DECODE_POOL if "decode" in router.live_roles() else MIXED_POOL


@dataclass(frozen=True)
class GuestPlacement:
    held: Mapping[str, int] = field(default_factory=dict)  # executor -> guests it holds
    reserve_executors: int = 0

    def __post_init__(self) -> None:
        if self.reserve_executors < 0:
            raise ValueError("reserve_executors must be >= 0")

    def guest_executors(self, router: Router, roles: Sequence[str]) -> list[str]:
        """The executors of this pool that guests may go to now (module docstring)."""
        pool = router.pool(roles)
        allowed = max(0, len(pool) - self.reserve_executors)
        ranked = sorted(
            pool, key=lambda e: (-self.held.get(e, 0), -router.executors[e].free_seqs, e)
        )
        return sorted(ranked[:allowed])

    def among(
        self,
        router: Router,
        req: TokenizedRequest,
        candidates: list[str],
        roles: Sequence[str],
    ) -> list[str]:
        """Of ``candidates`` (executors of ``roles`` with room), those ``req`` may go to."""
        if req.guest:
            allowed = set(self.guest_executors(router, roles))
            return [e for e in candidates if e in allowed]
        if not any(self.held.get(e, 0) for e in candidates):
            return candidates
        # Not merely room: a guest-free executor whose slots are all taken would leave the
        # request in its local queue until a sequence finishes, where a guest executor's
        # guest yields its slot at the next step.
        preferred = [
            e for e in candidates if not self.held.get(e, 0) and router.executors[e].free_seqs > 0
        ]
        return preferred or candidates

    def guest_room(self, router: Router, reserve_seqs: int, roles: Sequence[str]) -> int:
        """Sequence slots guests may take now: free ones on the guest executors of this pool,
        as long as the pool keeps ``reserve_seqs`` slots free in all for the region's own
        clients (``--spill-reserve-seqs``). The free slots of the executors taking no guests
        count towards that reserve: they are where the region's own requests go first, so
        keeping it again on a guest executor would leave a slot there idle (a quarter of
        what an executor of 4 slots lends)."""
        free = {e: router.executors[e].free_seqs for e in router.pool(roles)}
        lendable = sum(free[e] for e in self.guest_executors(router, roles))
        return max(0, min(lendable, sum(free.values()) - reserve_seqs))

    def spare_seqs(self, router: Router, reserve_seqs: int) -> int:
        """What this region reports to the others as its spare slots (``guest_room`` of the
        pool guests live on)."""
        return self.guest_room(router, reserve_seqs, guest_pool(router))
