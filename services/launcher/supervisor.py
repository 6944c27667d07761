"""Restart the processes of ``meshserve up`` that die, with backoff, and give up on crash loops.

Any exit that the caller did not ask for counts, a clean one included: a service someone sent
SIGTERM leaves the mesh without its role just as a crash does.

Pure bookkeeping over anything with ``pid``, ``returncode`` and ``poll()`` (a ``Popen``); the
caller says how to start a process again, polls, and decides what giving up means (``up``
stops the whole mesh). The clock is injectable so the policy is testable without sleeping.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import FrameType
from typing import Protocol


class Process(Protocol):
    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...


@dataclass(frozen=True)
class RestartPolicy:
    initial_delay_s: float = 0.5
    max_delay_s: float = 10.0
    # Up this long: the process is healthy, and its next crash starts the backoff over.
    stable_after_s: float = 30.0
    # This many crashes within the window: give up. With the delays above, a process that
    # dies within a few seconds of every start reaches 5 in about 20-40 s.
    max_crashes: int = 5
    crash_window_s: float = 60.0

    def delay(self, streak: int) -> float:
        """The wait before restart number ``streak`` since the process last stayed up."""
        return float(min(self.max_delay_s, self.initial_delay_s * 2 ** max(0, streak - 1)))


class GaveUp(RuntimeError):
    """A process crashed too often to be worth restarting again."""


def describe_exit(returncode: int) -> str:
    """``Popen`` reports death by a signal as a negative return code."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _to_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@dataclass
class Watched:
    name: str
    proc: Process
    restart: Callable[[], Process]
    min_delay_s: float
    started_at: float
    streak: int = 0  # crashes since the process last stayed up ``stable_after_s``
    crashes: deque[float] = field(default_factory=deque)  # when, within the window
    restart_at: float | None = None  # set while it is dead and waiting for its delay


@dataclass
class Supervisor:
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    clock: Callable[[], float] = time.monotonic
    log: Callable[[str], None] = field(default=_to_stderr)
    # Wraps every restart; ``up`` holds Ctrl-C off meanwhile so that a process started just
    # then is never left out of what it stops.
    guard: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
    watched: dict[str, Watched] = field(default_factory=dict)

    def watch(
        self,
        name: str,
        proc: Process,
        restart: Callable[[], Process],
        min_delay_s: float = 0.0,
    ) -> None:
        """Supervise ``proc``; ``restart()`` starts its replacement (and may raise, which
        counts as one more crash)."""
        self.watched[name] = Watched(name, proc, restart, min_delay_s, self.clock())

    def poll(self) -> None:
        """Notice deaths, restart those whose delay is over; ``GaveUp`` on a crash loop."""
        for w in self.watched.values():
            now = self.clock()
            if w.restart_at is None:
                code = w.proc.poll()
                if code is None:
                    if w.streak and now - w.started_at >= self.policy.stable_after_s:
                        w.streak = 0
                    continue
                self._crashed(w, now, f"(pid {w.proc.pid}) died ({describe_exit(code)})")
            elif now >= w.restart_at:
                self._restart(w)

    def _crashed(self, w: Watched, now: float, what: str) -> None:
        # Giving up, rather than retrying forever: a process that dies again and again right
        # after starting almost always fails for a reason a restart cannot change (a bad flag
        # or model, a port taken, out of memory while loading). Looping would hide that from
        # whoever started ``up`` (a terminal, systemd, a CI job) behind a mesh that looks
        # alive but lacks a service for good; a non-zero exit tells them.
        w.crashes.append(now)
        while w.crashes and now - w.crashes[0] > self.policy.crash_window_s:
            w.crashes.popleft()
        if len(w.crashes) >= self.policy.max_crashes:
            raise GaveUp(
                f"{w.name} {what}; it crashed {len(w.crashes)} times within "
                f"{self.policy.crash_window_s:.0f} s, giving up on it"
            )
        w.streak += 1
        delay = max(w.min_delay_s, self.policy.delay(w.streak))
        w.restart_at = now + delay
        self.log(f"meshserve up: {w.name} {what}; restarting it in {delay:.1f} s")

    def _restart(self, w: Watched) -> None:
        try:
            with self.guard():
                w.proc = w.restart()
        except (OSError, RuntimeError) as exc:
            w.restart_at = None
            self._crashed(w, self.clock(), f"could not be restarted ({exc})")
            return
        w.restart_at = None
        w.started_at = self.clock()
        self.log(f"meshserve up: {w.name} restarted (pid {w.proc.pid})")


@dataclass
class DeferredInterrupt:
    """SIGINT/SIGTERM handler that raises ``KeyboardInterrupt``, except inside ``deferred()``,
    where it waits for the block to end (a process being started there gets registered)."""

    deferring: bool = False
    pending: bool = False
    # Raised once: a second signal right behind the first (a process manager and a user at
    # once) would interrupt the stopping it started; the caller installs its own handler
    # for the signals after that (``up``'s: a second Ctrl-C kills).
    fired: bool = False

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.fired:
            return
        if self.deferring:
            self.pending = True
            return
        self.fired = True
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        outer = self.deferring
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = outer
            if self.pending and not outer:  # even if the block failed: stopping comes first
                self.pending = False
                self.fired = True
                raise KeyboardInterrupt
