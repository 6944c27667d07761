"""What the regions bench asks of a region's scheduler, in one place for both of its region
children (``region_mesh.py`` in one process, ``region_service.py`` per service): its spilling
switched on or off between rounds, how many requests it sent elsewhere, the measured RTT."""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time

from common.metrics import counter_total
from services.scheduler.spill import RegionSpill


class SpillSwitch:
    def __init__(self, spill: RegionSpill) -> None:
        self.spill = spill
        self.configs = {
            True: spill.config,
            False: dataclasses.replace(spill.config, peer_regions=()),
        }

    def set(self, on: bool) -> None:
        self.spill.config = self.configs[on]  # read afresh on every decision

    def spilled(self) -> int:
        """Requests this scheduler sent to another region so far."""
        return int(counter_total(self.spill.spilled_total))

    async def rtt_ms(self, timeout: float = 20) -> float:
        """The median round trip to the peers, once a load report has crossed the link."""
        deadline = time.monotonic() + timeout
        while not self.spill.remotes(1):
            if time.monotonic() > deadline:
                raise TimeoutError("no load report crossed the gateway link")
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # a few more polls: the first one pays for connection set-up
        return statistics.median(p.rtt_ms for p in self.spill.peers.values())
