"""What ``meshserve up`` puts on its console, from the services' logs and ``/health``, without
starting anything (``tests/test_up.py`` runs the real thing)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from services.launcher.console import LineFilter, ReadyReport, ServiceLogs, ready_names

T = "2026-12-01 10:47:51,607"


def shown(lines: list[str], level: int = logging.WARNING) -> list[str]:
    keep = LineFilter(level)
    return [line for line in lines if keep(line)]


def test_records_below_the_level_stay_in_the_file():
    lines = [
        f"{T} INFO meshserve.executor: executor config: ExecutorConfig(...)",
        f'{T} INFO aiohttp.access: 127.0.0.1 "GET /health HTTP/1.1" 503 663',
        f"{T} WARNING meshserve: gateway: disconnected from nats",
        f"{T} ERROR meshserve: scheduler: dropping bad message on x: bad",
    ]
    assert shown(lines) == lines[2:]
    assert shown(lines, logging.ERROR) == lines[3:]
    assert shown(lines, logging.INFO) == lines
    assert shown(["Loading: 100%|####| 1/1", *lines], logging.DEBUG)[0] == "Loading: 100%|####| 1/1"


def test_a_traceback_shows_its_exception_and_a_record_its_continuation():
    uncaught = [
        "Traceback (most recent call last):",
        '  File "service.py", line 46, in parse_args',
        "    default=float(env('INDEX_EXECUTOR_TIMEOUT', '30'))",
        "ValueError: could not convert string to float: 'x'",
    ]
    assert shown(uncaught) == [uncaught[-1]]
    assert shown(uncaught, logging.DEBUG) == uncaught
    logged = [f"{T} ERROR meshserve: tokenizer: handler for x failed", *uncaught]
    assert shown([f"{T} INFO meshserve: fine", *logged]) == [logged[0], uncaught[-1]]
    warned = ["/x/y.py:3: UserWarning: careful", "  warnings.warn('careful')"]
    assert shown([f"{T} INFO meshserve: fine", *warned, "tqdm 50%"]) == [*warned, "tqdm 50%"]
    assert shown(warned, logging.ERROR) == []


def test_service_logs_echo_new_complete_lines_and_keep_them_across_a_restart(tmp_path: Path):
    seen: list[str] = []
    logs = ServiceLogs(tmp_path / "logs", show=seen.append)
    with logs.open("executor-0") as f:
        f.write(f"{T} INFO meshserve: executor executor-0 connected\n".encode())
        f.write(f"{T} WARNING meshserve: exec".encode())
        f.flush()
        logs.echo()
        assert seen == []  # a line is shown once it is whole
        f.write(b"utor-0: slow step\n")
        f.flush()
        logs.echo()
    assert seen == ["executor-0: WARNING meshserve: executor-0: slow step"]
    with logs.open("executor-0") as f:  # the restarted process appends
        f.write(b"ValueError: boom\n")
    logs.echo()
    assert seen[-1] == "executor-0: ValueError: boom"
    text = logs.path("executor-0").read_text()
    assert "connected" in text and "boom" in text
    # a new ``up`` empties the file its first start writes to
    with ServiceLogs(tmp_path / "logs", show=seen.append).open("executor-0"):
        pass
    assert logs.path("executor-0").read_text() == ""


def test_ready_names_map_health_stages_to_up_names():
    names = ["tokenizer", "prefix-index", "scheduler", "detokenizer-0", "detokenizer-1"]
    names += ["executor-0", "executor-1", "prefill-0", "decode-0", "gateway"]
    assert ready_names(names, None) == set()
    health = {
        "stages": {
            "tokenizer": {"live": ["vm-1"]},
            "prefix-index": {"live": []},
            "scheduler": {"live": ["vm-2"]},
            "detokenizer": {"live": ["vm-3"], "shards": {"0": ["vm-3"], "1": []}},
            "executor": {"live": ["executor-1", "decode-0"], "draining": [], "refused": {}},
        }
    }
    got = ready_names(names, health)
    assert got == {"tokenizer", "scheduler", "detokenizer-0", "executor-1", "decode-0", "gateway"}


def test_ready_report_shows_each_service_once_and_waits_for_all():
    seen: list[str] = []
    report = ReadyReport(["tokenizer", "executor-0", "gateway"], show=seen.append)
    assert not report(None)
    health: dict[str, Any] = {"stages": {"tokenizer": {"live": ["a"]}, "executor": {"live": []}}}
    assert not report((503, health))
    assert not report((503, health))
    assert seen == ["  tokenizer ready", "  gateway ready"]
    health["stages"]["executor"]["live"] = ["executor-0"]
    assert report((200, health))
    assert seen[-1] == "  executor-0 ready" and len(seen) == 3
