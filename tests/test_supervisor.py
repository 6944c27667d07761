"""The restart policy of ``meshserve up`` on fake processes and a fake clock (no sleeping)."""

from __future__ import annotations

import itertools
import signal

import pytest

from services.launcher.supervisor import (
    DeferredInterrupt,
    GaveUp,
    RestartPolicy,
    Supervisor,
    describe_exit,
)

PIDS = itertools.count(100)


class FakeProcess:
    def __init__(self) -> None:
        self.pid = next(PIDS)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """One supervised service; ``restarts`` are the delays between a death and its restart."""

    def __init__(self, policy: RestartPolicy | None = None, min_delay_s: float = 0.0) -> None:
        self.clock = Clock()
        self.lines: list[str] = []
        self.sup = Supervisor(policy or RestartPolicy(), self.clock, self.lines.append)
        self.proc = FakeProcess()
        self.fail_restart = False
        self.sup.watch("executor-0", self.proc, self.start, min_delay_s)

    def start(self) -> FakeProcess:
        if self.fail_restart:
            raise RuntimeError("port in use")
        self.proc = FakeProcess()
        return self.proc

    def advance(self, seconds: float, step: float = 0.125) -> None:  # exact in binary
        end = self.clock.now + seconds
        while self.clock.now < end - 1e-9:
            self.clock.now = min(end, self.clock.now + step)
            self.sup.poll()

    def crash_and_restart(self, code: int = -signal.SIGKILL) -> float:
        """Kill the current process; return the seconds until its replacement started."""
        old = self.proc
        old.returncode = code
        died = self.clock.now
        self.sup.poll()
        while self.proc is old:
            self.advance(0.125)
        return self.clock.now - died


def test_describe_exit():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(0) == "exit code 0"


def test_backoff_doubles_to_the_cap_and_logs_name_cause_and_delay():
    policy = RestartPolicy(max_crashes=100)
    h = Harness(policy)
    h.advance(1)
    old_pid = h.proc.pid
    delays = [h.crash_and_restart() for _ in range(7)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert h.lines[0] == (
        f"meshserve up: executor-0 (pid {old_pid}) died (killed by SIGKILL); restarting it in 0.5 s"
    )
    assert h.lines[1] == f"meshserve up: executor-0 restarted (pid {old_pid + 1})"


def test_backoff_starts_over_after_the_process_stayed_up():
    h = Harness(RestartPolicy(max_crashes=100))
    assert [h.crash_and_restart(1) for _ in range(3)] == [0.5, 1.0, 2.0]
    h.advance(29)
    assert h.crash_and_restart(1) == 4.0  # not up long enough to count as healthy
    h.advance(31)
    assert h.crash_and_restart(1) == 0.5


def test_gives_up_on_a_crash_loop():
    h = Harness()  # 5 crashes within 60 s
    for _ in range(4):
        h.crash_and_restart(1)
    h.proc.returncode = 1
    with pytest.raises(GaveUp, match=r"executor-0 .*exit code 1.*5 times within 60 s"):
        h.advance(0.1)


def test_slow_crashes_are_retried_for_ever():
    """A process that dies only after running a while is restarted however often it dies."""
    h = Harness()
    for _ in range(20):
        h.advance(20)
        assert h.crash_and_restart(1) <= 10.0


def test_a_failed_restart_counts_as_a_crash():
    h = Harness()
    h.proc.returncode = -signal.SIGKILL
    h.fail_restart = True
    h.sup.poll()
    h.advance(0.75)  # the first try, at 0.5 s, fails; the next one waits twice as long
    assert h.lines[-1] == "meshserve up: executor-0 could not be restarted (port in use); " + (
        "restarting it in 1.0 s"
    )
    h.fail_restart = False
    h.advance(1.0)
    assert h.lines[-1] == f"meshserve up: executor-0 restarted (pid {h.proc.pid})"


def test_min_delay_holds_back_a_quick_restart():
    h = Harness(min_delay_s=3.0)
    assert h.crash_and_restart() == 3.0


def test_interrupt_waits_for_the_deferred_block():
    interrupts = DeferredInterrupt()
    ran_to_end = False
    with pytest.raises(KeyboardInterrupt), interrupts.deferred():
        interrupts.handler(signal.SIGINT, None)  # as if Ctrl-C came now
        ran_to_end = True
    assert ran_to_end
    interrupts = DeferredInterrupt()
    with pytest.raises(KeyboardInterrupt), interrupts.deferred():
        interrupts.handler(signal.SIGTERM, None)
        raise RuntimeError("the restart failed")  # the interrupt is not lost with it
    interrupts = DeferredInterrupt()
    with pytest.raises(KeyboardInterrupt):
        interrupts.handler(signal.SIGINT, None)
    # Raised once: a second signal right behind it (a process manager's SIGTERM and a user's
    # Ctrl-C) does not interrupt the stopping the first began; up's own handler takes the
    # signals after that.
    interrupts.handler(signal.SIGTERM, None)
    with interrupts.deferred():
        interrupts.handler(signal.SIGINT, None)
