"""Which sequence owns which KV page, and the local prefix cache.

Pages are reference-counted. A page whose tokens are all computed gets the chained hash of its
prefix (``common.page_hash``) and becomes shareable: a later sequence whose prompt starts with
the same tokens takes the page instead of recomputing it. A page nobody references keeps its
hash and waits in an LRU queue; it is evicted (its hash forgotten) only when a fresh page is
needed and the free list is empty. Stored and evicted hashes are reported as ``KVEvent``s so an
index elsewhere can mirror this cache.

Invariants (``check_invariants``): every page is exactly one of {free, cached-unreferenced,
referenced}; ref counts equal the number of page tables holding the page; the hash map and the
per-page hashes agree.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from common.page_hash import ROOT_HASH, page_hash


@dataclass(frozen=True)
class KVEvent:
    kind: str  # "stored" | "evicted"
    page_hash: int
    parent_hash: int = ROOT_HASH


@dataclass
class PageTable:
    """A sequence's pages, in order, and how many of them carry a prefix-cache hash."""

    pages: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hashes[i] belongs to pages[i]
    root: int = ROOT_HASH  # the hash chain's seed: its LoRA adapter's (``namespace_root``)


class PageManager:
    """The KV cache's pages (``num_pages`` of ``page_size`` tokens): who holds each, and the
    prefix cache over them."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.page_hash: list[int | None] = [None] * num_pages
        self.hash_to_page: dict[int, int] = {}
        # A min-heap: the lowest free page goes first, so a sequence's pages come out in runs
        # (a KV transfer copies a run, consecutive on both sides, as one extent).
        self.free_pages: list[int] = list(range(num_pages))
        # How far an eviction follows the run it ends (``_evict_for``).
        self.evict_batch = num_pages // 8
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.events: list[KVEvent] = []
        # Prefix-cache metrics, counted once per request at its first admission (see
        # record_lookup), so hits / queries is the hit rate clients see in usage.cached_tokens.
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which served from it

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (free or evictable)."""
        return len(self.free_pages) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_pages

    def pages_needed(self, table: PageTable, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(table.pages))

    def can_allocate(self, table: PageTable, num_tokens: int) -> bool:
        return self.pages_needed(table, num_tokens) <= self.num_free

    # -- prefix cache ------------------------------------------------------------------------
    def match_prefix(self, table: PageTable, tokens: list[int]) -> int:
        """Attach cached pages covering a prefix of ``tokens`` to an empty table.

        Returns the number of tokens served from cache. At least one token is always left to
        compute, since the step that computes it also produces the next token's logits.
        """
        assert not table.pages, "match_prefix needs an empty page table"
        if not self.enable_prefix_caching:
            return 0
        parent = table.root
        for start in range(0, len(tokens) - 1 - self.page_size + 1, self.page_size):
            h = page_hash(parent, tokens[start : start + self.page_size])
            page = self.hash_to_page.get(h)
            if page is None:
                break
            self._take(page)
            table.pages.append(page)
            table.hashes.append(h)
            parent = h
        return len(table.pages) * self.page_size

    def record_lookup(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count a request's lookup once: a lookup repeated while it waits for pages, or after
        a preemption, is not a new query (nor its recomputed prefix a new hit)."""
        self.queries += prompt_tokens
        self.hits += cached_tokens

    def commit_full_pages(self, table: PageTable, tokens: list[int], num_computed: int) -> None:
        """Hash every page whose tokens are now all computed, making it shareable."""
        if not self.enable_prefix_caching:
            return
        full = min(num_computed // self.page_size, len(table.pages))
        for i in range(len(table.hashes), full):
            parent = table.hashes[-1] if table.hashes else ROOT_HASH
            seed = parent if table.hashes else table.root
            h = page_hash(seed, tokens[i * self.page_size : (i + 1) * self.page_size])
            page = table.pages[i]
            table.hashes.append(h)
            if h not in self.hash_to_page:
                self.hash_to_page[h] = page
                self.page_hash[page] = h
                self.events.append(KVEvent("stored", h, parent))
            # else: the same prefix was computed twice concurrently; this copy stays private.

    # -- allocation --------------------------------------------------------------------------
    def allocate(self, table: PageTable, num_tokens: int) -> bool:
        """Grow ``table`` to hold ``num_tokens`` tokens; False (and no change) if out of pages."""
        needed = self.pages_needed(table, num_tokens)
        if needed > self.num_free:
            return False
        self._evict_for(needed - len(self.free_pages))
        for _ in range(needed):
            page = heapq.heappop(self.free_pages)
            self.ref_counts[page] = 1
            table.pages.append(page)
        return True

    def free(self, table: PageTable) -> None:
        """Drop a sequence's references; last-referenced pages go to the back of the LRU."""
        self._release_tail(table, 0)
        table.hashes.clear()

    def truncate(self, table: PageTable, num_tokens: int) -> None:
        """Release the pages past the first ``num_tokens`` tokens (the pages of rejected
        speculative tokens). Only full pages of accepted tokens carry hashes; those stay."""
        keep = -(-num_tokens // self.page_size)
        if keep < len(table.hashes):
            raise ValueError(f"cannot truncate below {len(table.hashes)} hashed pages")
        self._release_tail(table, keep)

    def _release_tail(self, table: PageTable, keep: int) -> None:
        # Free the tail first so that, among one sequence's pages, later pages evict first.
        for page in reversed(table.pages[keep:]):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                if self.page_hash[page] is not None:
                    self.evictable[page] = None
                else:
                    heapq.heappush(self.free_pages, page)
        del table.pages[keep:]

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached page (e.g. after weights change)."""
        while self.evictable:
            self._evict(next(iter(self.evictable)))

    def _take(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            self.evictable.pop(page, None)
        self.ref_counts[page] += 1

    def _evict_for(self, short: int) -> None:
        """Evict ``short`` pages, least recently used first, and then the rest of the run the
        last one ends (a table's tail is evicted first, so its next page is one lower), up to
        ``evict_batch`` more: the allocation that follows takes the lowest free page first, so
        a prompt that reuses an old prompt's pages gets them as one run, chunk after chunk."""
        if short <= 0:
            return
        for _ in range(short):
            last = next(iter(self.evictable))
            self._evict(last)
        for _ in range(self.evict_batch):
            page = next(iter(self.evictable), None)
            if page != last - 1:
                return
            self._evict(page)
            last = page

    def _evict(self, page: int) -> None:
        h = self.page_hash[page]
        assert h is not None
        del self.evictable[page]
        del self.hash_to_page[h]
        self.page_hash[page] = None
        heapq.heappush(self.free_pages, page)
        self.events.append(KVEvent("evicted", h))

    def check_invariants(self, tables: list[PageTable]) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent with the live page tables."""
        refs = [0] * self.num_pages
        for table in tables:
            for page in table.pages:
                refs[page] += 1
            assert len(table.hashes) <= len(table.pages)
        assert refs == self.ref_counts, "ref counts disagree with page tables"
        free = set(self.free_pages)
        assert len(free) == len(self.free_pages), "a page is on the free list twice"
        for page in range(self.num_pages):
            states = (page in free) + (page in self.evictable) + (refs[page] > 0)
            assert states == 1, f"page {page} is in {states} states"
            if page in free:
                assert self.page_hash[page] is None
            if page in self.evictable:
                assert self.page_hash[page] is not None
        for h, page in self.hash_to_page.items():
            assert self.page_hash[page] == h
        assert sum(h is not None for h in self.page_hash) == len(self.hash_to_page)
