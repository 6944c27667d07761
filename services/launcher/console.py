"""What ``meshserve up`` shows on its console: each service once, when the mesh sees it ready,
and the warnings and errors from the services' logs. Everything a service writes goes to its
own file, ``<log dir>/<name>.log``; the console is for what a user has to act on.

Pure bookkeeping over files and ``/health`` bodies (no processes, no HTTP), so the filters are
testable alone.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# common.runtime's log format: "2026-12-01 10:47:51,607 INFO meshserve.scheduler: ..."
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ([A-Z]+) ")
LEVELS = ("debug", "info", "warning", "error")


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class LineFilter:
    """Which lines of one service's output reach the console: log records at ``level`` or
    above and the lines that continue them, Python warnings, and of a traceback only what is
    not indented (the exception, and how chained ones relate); the whole traceback is in the
    file. At ``debug``, every line. The rest (INFO records, progress bars) stays in the file."""

    level: int = logging.WARNING
    showing: bool = False  # whether the last record (or warning) was shown
    in_traceback: bool = False

    def __call__(self, line: str) -> bool:
        if self.level <= logging.DEBUG:
            return True
        record = RECORD.match(line)
        if record:
            level = logging.getLevelNamesMapping().get(record.group(1), logging.INFO)
            self.showing, self.in_traceback = level >= self.level, False
        elif line.startswith("Traceback (most recent call last):"):
            self.in_traceback = True
            return False
        elif self.in_traceback:
            return not line.startswith((" ", "\t"))
        elif re.search(r"\b\w*Warning: ", line):
            self.showing = self.level <= logging.WARNING
        return self.showing


def shorten(line: str) -> str:
    """A log record without its timestamp (the console is read as it happens)."""
    record = RECORD.match(line)
    return line[record.start(1) :] if record else line


@dataclass
class _Tail:
    path: Path
    keep: LineFilter
    offset: int = 0
    partial: str = ""


@dataclass
class ServiceLogs:
    """One log file per service under ``folder``, read back as it grows."""

    folder: Path
    level: int = logging.WARNING
    show: Callable[[str], None] = to_stderr
    tails: dict[str, _Tail] = field(default_factory=dict)

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def open(self, name: str) -> IO[bytes]:
        """The file for service ``name``'s stdout and stderr: emptied when it first starts,
        appended to when it is restarted (what it wrote before it died stays)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(name)
        if name not in self.tails:
            self.tails[name] = _Tail(path, LineFilter(self.level))
            return path.open("wb")
        return path.open("ab")

    def echo(self) -> None:
        """Show the new lines of every log that pass its filter, as ``name: line``."""
        for name, tail in self.tails.items():
            try:
                with tail.path.open("rb") as f:
                    f.seek(tail.offset)
                    data = f.read()
            except OSError:
                continue
            tail.offset += len(data)
            *lines, tail.partial = (tail.partial + data.decode(errors="replace")).split("\n")
            for line in lines:
                if line.strip() and tail.keep(line):
                    self.show(f"{name}: {shorten(line)}")


def ready_names(names: Iterable[str], health: dict[str, Any] | None) -> set[str]:
    """Which of ``up``'s services (``tokenizer``, ``detokenizer-0``, ``executor-1``, ...) the
    gateway's ``/health`` body lists as live: executors by id (``up`` names them), detokenizers
    by shard, the rest by having any live member. The gateway is ready once it answers."""
    if health is None:
        return set()
    stages = health.get("stages", {})
    ready = set()
    for name in names:
        stage, _, index = name.rpartition("-")
        if name == "gateway":
            ok = True
        elif stage in ("executor", "prefill", "decode"):  # executor ids, by role
            ok = name in stages.get("executor", {}).get("live", [])
        elif stage == "detokenizer":
            ok = bool(stages.get("detokenizer", {}).get("shards", {}).get(index))
        else:
            ok = bool(stages.get(name, {}).get("live"))
        if ok:
            ready.add(name)
    return ready


def to_stdout(line: str) -> None:
    print(line, flush=True)


@dataclass
class ReadyReport:
    """Shows each of ``names`` once, when ``/health`` first lists it as live; called with each
    ``/health`` answer, it says whether the mesh is up: healthy, and every service seen."""

    names: list[str]
    show: Callable[[str], None] = to_stdout
    seen: set[str] = field(default_factory=set)

    def __call__(self, health: tuple[int, dict[str, Any]] | None) -> bool:
        ready = ready_names(self.names, None if health is None else health[1])
        for name in self.names:
            if name in ready and name not in self.seen:
                self.seen.add(name)
                self.show(f"  {name} ready")
        return health is not None and health[0] == 200 and self.seen >= set(self.names)
