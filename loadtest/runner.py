"""Arrival processes: open-loop Poisson arrivals at a rate, or a closed loop at a concurrency.

Both are bounded: no more than ``num_requests`` requests are sent, none after ``duration_s``
from the start, and every request is bounded by the client timeout, so a run ends by itself
(at the latest ``duration_s + timeout_s`` after it began).  Requests still in flight at the
duration bound are waited for, not cancelled.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import aiohttp
from tqdm import tqdm

from loadtest.client import Endpoint, RequestResult, send_request
from loadtest.workloads import RequestSpec, Workload

__all__ = ["LoadConfig", "RunResult", "new_session", "run_load", "warmup"]


@dataclass(frozen=True)
class LoadConfig:
    """How requests arrive and when the run stops."""

    mode: Literal["rate", "concurrency"]
    rate: float | None = None
    """Mean arrivals per second (open loop); ``inf`` sends everything at once."""
    concurrency: int | None = None
    """Requests kept in flight (closed loop)."""
    num_requests: int = 200
    duration_s: float | None = 600.0
    timeout_s: float = 300.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode == "rate" and (self.rate is None or not self.rate > 0):
            raise ValueError("rate mode needs a rate > 0")
        if self.mode == "concurrency" and (self.concurrency is None or self.concurrency < 1):
            raise ValueError("concurrency mode needs a concurrency >= 1")
        if self.num_requests < 1:
            raise ValueError("num_requests must be at least 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("duration must be > 0")
        if not self.timeout_s > 0:
            raise ValueError("timeout must be > 0")

    @property
    def label(self) -> str:
        if self.mode == "rate":
            assert self.rate is not None
            return "rate=inf" if math.isinf(self.rate) else f"rate={self.rate:g}"
        return f"concurrency={self.concurrency}"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if d["rate"] is not None and math.isinf(d["rate"]):
            d["rate"] = "inf"  # JSON has no infinity
        return d


@dataclass
class RunResult:
    """The requests of one run and how long it took."""

    load: LoadConfig
    results: list[RequestResult]
    duration_s: float
    max_in_flight: int
    started_at: str
    label: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def new_session() -> aiohttp.ClientSession:
    """A session with no connection limit (the load test sets concurrency itself)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=None),
    )


class _Tracker:
    """In-flight accounting, results and the progress bar of one run."""

    def __init__(self, total: int, label: str, progress: bool) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.results: list[RequestResult] = []
        self.failed = 0
        self.bar = tqdm(
            total=total,
            desc=label,
            unit="req",
            disable=not progress,
            file=sys.stderr,
            dynamic_ncols=True,
            leave=True,
        )

    def started(self) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def finished(self, result: RequestResult) -> None:
        self.in_flight -= 1
        self.results.append(result)
        if not result.success:
            self.failed += 1
            self.bar.set_postfix(failed=self.failed, refresh=False)
        self.bar.update(1)


async def run_load(
    endpoint: Endpoint,
    workload: Workload,
    load: LoadConfig,
    *,
    progress: bool = True,
    session: aiohttp.ClientSession | None = None,
    label: str | None = None,
) -> RunResult:
    """Run one bounded load test and return every request's result."""
    own = session is None
    sess = session if session is not None else new_session()
    label = label or load.label
    tracker = _Tracker(load.num_requests, label, progress)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    run_start = time.perf_counter()
    deadline = run_start + load.duration_s if load.duration_s is not None else math.inf

    async def issue(request_id: int, spec: RequestSpec, scheduled_s: float | None) -> None:
        tracker.started()
        result = await send_request(
            sess,
            endpoint,
            spec,
            request_id=request_id,
            run_start=run_start,
            timeout=load.timeout_s,
            scheduled_s=scheduled_s,
        )
        tracker.finished(result)
        workload.on_complete(spec, result.output_text if result.success else None)

    try:
        if load.mode == "rate":
            assert load.rate is not None
            await _open_loop(load, workload, issue, run_start, deadline)
        else:
            assert load.concurrency is not None
            await _closed_loop(load, workload, issue, deadline)
    finally:
        end = time.perf_counter()
        tracker.bar.close()
        if own:
            await sess.close()
    results = sorted(tracker.results, key=lambda r: r.request_id)
    return RunResult(load, results, end - run_start, tracker.max_in_flight, started_at, label)


_Issue = Callable[[int, RequestSpec, float | None], Any]


async def _open_loop(
    load: LoadConfig, workload: Workload, issue: _Issue, run_start: float, deadline: float
) -> None:
    """Poisson arrivals: exponential gaps with mean 1/rate, from a seeded generator."""
    assert load.rate is not None
    rng = random.Random(f"arrivals-{load.seed}")
    tasks: set[asyncio.Task[None]] = set()
    t = 0.0
    try:
        for i in range(load.num_requests):
            if i > 0 and not math.isinf(load.rate):
                t += rng.expovariate(load.rate)
            if run_start + t >= deadline:
                break
            delay = run_start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(issue(i, workload.next_request(), t))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in list(tasks):
            task.cancel()


async def _closed_loop(
    load: LoadConfig, workload: Workload, issue: _Issue, deadline: float
) -> None:
    """``concurrency`` workers, each sending its next request when the previous one ends."""
    assert load.concurrency is not None
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while issued < load.num_requests and time.perf_counter() < deadline:
            i = issued
            issued += 1
            await issue(i, workload.next_request(), None)

    workers = [asyncio.create_task(worker()) for _ in range(load.concurrency)]
    try:
        await asyncio.gather(*workers)
    finally:
        for w in workers:
            w.cancel()


async def warmup(
    endpoint: Endpoint,
    workload: Workload,
    num_requests: int,
    concurrency: int,
    timeout_s: float,
    session: aiohttp.ClientSession | None = None,
) -> int:
    """Send ``num_requests`` untimed requests, ``concurrency`` at a time; returns failures."""
    if num_requests <= 0:
        return 0
    load = LoadConfig(
        "concurrency",
        concurrency=max(1, concurrency),
        num_requests=num_requests,
        duration_s=None,
        timeout_s=timeout_s,
    )
    run = await run_load(endpoint, workload, load, progress=False, session=session, label="warmup")
    return sum(1 for r in run.results if not r.success)
