"""Which region serves a request: its own while the queue there is short, else the cheapest
(pure; no NATS, testable alone).

NATS serves a queue group in the local cluster first and fails over to another cluster only
when the local one has no member at all, so a region that is merely overloaded never spills by
itself. The scheduler adds that, with one rule (``choose_region``):

- the home region serves the request while its estimated queue time is within the budget
  (``--spill-queue-ms``), so local clients keep their low latency and their cache hits;
- beyond the budget, the request goes where it starts soonest::

      cost(r) = queue_ms(r) + rtt_ms(r) + uncached_tokens(r) * prefill_ms_per_token

  (home included, with rtt 0 and the prefix cache it holds), so a spill happens only when the
  other region, round trip and a cold prefill paid, still beats waiting at home;
- only into another region's spare sequence slots (free ones on its guest executors, while
  it keeps ``--spill-reserve-seqs`` free in all for its own clients; at least
  ``--spill-reserve-executors`` of its executors take no guests at all: ``guests.py``), so
  spilled work never queues in front of that region's clients. The sender counts on the
  slots last reported; the receiver enforces the reserve itself (its
  report may be a poll old): a spilled-in request queues behind all of its own clients'
  requests and is dispatched only while the region still has the reserve free after it
  (``SchedulerService.on_spilled``);
- a home region with no live executor sends everything to the cheapest live region that has
  an executor that may take a guest (a region without one sends guests back:
  ``SchedulerService.return_guests``).

A remote region's report older than ``stale_s`` is not counted on (the gateway link may be cut):
the request then stays home, where it is served once local capacity frees up.

Queue time is estimated from what the scheduler sees (``QueueEstimate``): the requests waiting
in its queue divided by the rate it dispatched requests over the last ``window_s`` seconds, and
at least the wait of the oldest queued one (a rate measured before the overload began
underestimates).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from common.config import region_ok
from common.settings import setting


@dataclass(frozen=True)
class RegionConfig:
    """The scheduler's region settings (``--peer-regions`` empty: no spillover)."""

    peer_regions: tuple[str, ...] = setting(
        (), "the other regions this scheduler may send requests to (a NATS supercluster)"
    )
    spill_queue_ms: float = setting(
        500.0,
        "serve a request in its own region while the estimated queue time there is within "
        "this; beyond it, send it to the region where it starts soonest",
    )
    prefill_ms_per_token: float = setting(
        0.2, "estimated prefill time per uncached prompt token (the cold-cache cost of a spill)"
    )
    spill_reserve_seqs: int = setting(
        1,
        "sequence slots this region keeps free for its own clients: it takes requests from "
        "other regions only beyond them",
    )
    spill_reserve_executors: int = setting(
        1,
        "executors of this region that take no requests from other regions, so its own "
        "clients' requests find one not kept busy by them (a region with no more executors "
        "than this takes none)",
    )
    status_interval_s: float = 0.25  # how often each peer region is asked for its load
    stale_s: float = 1.5  # a peer report older than this is not counted on

    def __post_init__(self) -> None:
        bad = [r for r in self.peer_regions if not region_ok(r)]
        if bad:
            raise ValueError(f"peer regions {bad}: lowercase letters, digits and '-' only")
        if self.spill_queue_ms < 0 or self.prefill_ms_per_token < 0:
            raise ValueError("spill_queue_ms and prefill_ms_per_token must be >= 0")
        if self.spill_reserve_seqs < 0:
            raise ValueError("spill_reserve_seqs must be >= 0")
        if self.spill_reserve_executors < 0:
            raise ValueError("spill_reserve_executors must be >= 0")


@dataclass(frozen=True)
class RegionLoad:
    """One region as a scheduler sees it now."""

    region: str
    live_executors: int
    queue_ms: float  # estimated wait of a request arriving there now
    rtt_ms: float = 0.0  # round trip from the deciding scheduler (0 at home)
    uncached_tokens: int = 0  # prompt tokens this request would prefill there
    # sequence slots free there beyond what it keeps for its own clients
    spare_seqs: int = 0
    guest_executors: int = 0  # its executors that may take a guest now


@dataclass(frozen=True)
class Decision:
    region: str
    reason: str  # "local", "over-budget", "no-local-executor", "no-better-region"
    cost_ms: float

    def spilled(self, home: str) -> bool:
        return self.region != home


def cost_ms(load: RegionLoad, prefill_ms_per_token: float) -> float:
    if load.live_executors == 0:
        return math.inf
    return load.queue_ms + load.rtt_ms + load.uncached_tokens * prefill_ms_per_token


def choose_region(
    home: RegionLoad, remotes: list[RegionLoad], budget_ms: float, prefill_ms_per_token: float
) -> Decision:
    """Where the request goes (module docstring). ``remotes``: fresh reports only."""
    home_cost = cost_ms(home, prefill_ms_per_token)
    if home.live_executors > 0 and home.queue_ms <= budget_ms:
        return Decision(home.region, "local", home_cost)
    # A region with live executors sends work only into another's spare slots: that one's own
    # clients keep their latency (its reserve). With none live, any region with an executor
    # that may take a guest will do, busy or not (one without would send it straight back).
    live = [
        r
        for r in remotes
        if r.live_executors > 0
        and r.guest_executors > 0
        and (home.live_executors == 0 or r.spare_seqs > 0)
    ]
    if not live:
        return Decision(home.region, "no-better-region", home_cost)
    best = min(live, key=lambda r: (cost_ms(r, prefill_ms_per_token), r.region))
    best_cost = cost_ms(best, prefill_ms_per_token)
    if best_cost >= home_cost:
        return Decision(home.region, "no-better-region", home_cost)
    reason = "no-local-executor" if home.live_executors == 0 else "over-budget"
    return Decision(best.region, reason, best_cost)


@dataclass
class QueueEstimate:
    """Estimated queue time from the scheduler's own dispatches (module docstring)."""

    window_s: float = 5.0
    dispatches: deque[float] = field(default_factory=deque)  # monotonic times

    def dispatched(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.dispatches.append(now)
        self._prune(now)

    def rate_per_s(self, now: float) -> float:
        self._prune(now)
        if len(self.dispatches) < 2:
            return 0.0
        span = max(now - self.dispatches[0], 1e-3)
        return len(self.dispatches) / span

    def queue_ms(self, queued: int, oldest_wait_s: float, has_room: bool, now: float) -> float:
        """Wait of a request arriving now behind ``queued`` others."""
        if queued == 0 and has_room:
            return 0.0
        rate = self.rate_per_s(now)
        by_rate = (queued + 1) / rate if rate > 0 else oldest_wait_s
        return 1000.0 * max(by_rate, oldest_wait_s)

    def _prune(self, now: float) -> None:
        while self.dispatches and now - self.dispatches[0] > self.window_s:
            self.dispatches.popleft()
