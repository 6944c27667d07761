"""``python -m services.scheduler``."""

from __future__ import annotations

from common.runtime import run_service
from services.scheduler.service import SchedulerService, parse_args

if __name__ == "__main__":
    run_service("scheduler", parse_args, SchedulerService)
