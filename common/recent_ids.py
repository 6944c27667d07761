"""Request ids that ended recently, remembered for a while (tombstones).

Messages about one request reach a service along different paths (the client's abort comes
from the gateway, the request itself via the tokenizer and the scheduler), so "this request
is over" may arrive before the request does. Each service that can receive a request after
its end keeps the ended ids here, and drops a request whose id it finds. Gateways make
request ids unique, so a tombstone never stands in a new request's way. What a tombstone must
outlast is the journey of a message that left before it (seconds; a publisher reconnecting
after an outage sends its buffer late), not the request's life: entries expire after
``ttl_s`` and the oldest go first beyond ``max_size``, so the set stays bounded (about 250
bytes an entry) whatever the traffic.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


@dataclass
class RecentIds(Generic[K, V]):
    ttl_s: float = 120.0
    max_size: int = 50_000
    clock: Callable[[], float] = time.monotonic
    _entries: OrderedDict[K, tuple[float, V]] = field(default_factory=OrderedDict)

    def add(self, key: K, value: V) -> None:
        self._entries.pop(key, None)
        self._entries[key] = (self.clock() + self.ttl_s, value)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def add_all(self, keys: Iterable[K], value: V) -> None:
        for key in keys:
            self.add(key, value)

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None or entry[0] < self.clock():
            return None
        return entry[1]

    def discard(self, key: K) -> None:
        self._entries.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return self.get(key) is not None  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[K]:
        """The keys not yet expired, oldest first."""
        now = self.clock()
        return [key for key, (expires, _) in self._entries.items() if expires >= now]

    def prune(self) -> None:
        """Forget expired entries (insertion order is expiry order: same ttl for all)."""
        now = self.clock()
        while self._entries:
            key, (expires, _) = next(iter(self._entries.items()))
            if expires >= now:
                break
            del self._entries[key]
