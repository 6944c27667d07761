"""The page manager's rules without a model: pages handed out in order, shared by reference
count, hashed only when full and computed, matched leaving a token to compute, and cached
free pages evicted least recently used first, a sequence's tail first."""

from __future__ import annotations

import copy
import itertools
import random

import pytest

from common.page_hash import ROOT_HASH
from tests.core_helpers import (
    KVEvent,
    PageTable,
    check_pages,
    make_core,
    make_pages,
    make_seq,
    page_hashes,
    tokens,
)


def computed(pm, toks: list[int]) -> PageTable:
    """A table that computed ``toks`` from scratch (its full pages hashed)."""
    table = PageTable()
    assert pm.allocate(table, len(toks))
    pm.commit_full_pages(table, toks, len(toks))
    return table


def test_allocate_grows_a_table_a_page_at_a_time_and_fails_without_a_change():
    pm = make_pages(4, 4)
    t = PageTable()
    assert pm.allocate(t, 9) and t.pages == [0, 1, 2]
    assert pm.ref_counts == [1, 1, 1, 0] and pm.num_free == 1
    assert pm.allocate(t, 12) and t.pages == [0, 1, 2]  # room in the last page
    other = PageTable()
    assert not pm.allocate(other, 5)  # 2 pages, 1 free
    assert other.pages == [] and pm.num_free == 1 and pm.ref_counts == [1, 1, 1, 0]
    assert pm.allocate(other, 4) and other.pages == [3]
    assert pm.num_free == 0 and pm.usage == 1.0
    check_pages(pm, [t, other])
    pm.free(t)
    assert t.pages == [] and pm.ref_counts == [0, 0, 0, 1] and pm.num_free == 3
    assert pm.evictable == {}  # nothing was hashed: plain free pages
    check_pages(pm, [t, other])


def test_only_full_computed_pages_are_hashed_and_announced():
    pm = make_pages(8, 4)
    toks = tokens(10)
    t = PageTable()
    assert pm.allocate(t, 10)
    pm.commit_full_pages(t, toks, 3)
    assert t.hashes == [] and pm.hash_to_page == {}
    pm.commit_full_pages(t, toks, 7)
    h = page_hashes(toks, 4)
    assert t.hashes == h[:1]
    pm.commit_full_pages(t, toks, 10)  # the third page holds 2 tokens: no hash
    assert t.hashes == h and len(h) == 2
    assert pm.hash_to_page == {h[0]: t.pages[0], h[1]: t.pages[1]}
    assert pm.page_hash == [h[0], h[1], None, None, None, None, None, None]
    assert pm.drain_events() == [KVEvent("stored", h[0], ROOT_HASH), KVEvent("stored", h[1], h[0])]
    check_pages(pm, [t])


def test_a_match_takes_cached_full_pages_and_always_leaves_a_token_to_compute():
    pm = make_pages(8, 4)
    toks = tokens(12)
    donor = computed(pm, toks)
    cached = list(donor.pages)
    pm.free(donor)
    # (tokens looked up, tokens served from the cache)
    cases = [
        ([*toks, *tokens(1)], 12),
        (toks, 8),  # all 3 pages cached, but the 12th token must be computed
        (toks[:9], 8),
        (toks[:8], 4),
        (toks[:4], 0),
        ([*toks[:6], *tokens(6)], 4),  # diverges inside the second page
        ([*tokens(1), *toks[1:]], 0),  # a different first token: a different chain
    ]
    for lookup, hit in cases:
        t = PageTable()
        assert pm.match_prefix(t, lookup) == hit, (len(lookup), hit)
        n = hit // 4
        assert t.pages == cached[:n] and t.hashes == page_hashes(toks, 4)[:n]
        assert [pm.ref_counts[p] for p in cached] == [1] * n + [0] * (3 - n)
        assert pm.num_free == 8 - n
        check_pages(pm, [t])
        pm.free(t)
    assert pm.queries == 0 and pm.hits == 0  # counted per request by the scheduler, not here


def test_a_shared_page_counts_each_holder_and_is_freed_when_the_last_one_lets_go():
    pm = make_pages(8, 4)
    toks = tokens(10)
    first = computed(pm, toks)  # 3 pages, the first 2 hashed
    second = PageTable()
    assert pm.match_prefix(second, [*toks[:8], *tokens(1)]) == 8
    assert pm.allocate(second, 9)
    shared = first.pages[:2]
    assert second.pages[:2] == shared and second.pages[2] not in first.pages
    assert [pm.ref_counts[p] for p in shared] == [2, 2]
    assert pm.ref_counts[first.pages[2]] == pm.ref_counts[second.pages[2]] == 1
    assert pm.num_free == 8 - 4
    pm.free(first)
    assert [pm.ref_counts[p] for p in shared] == [1, 1]
    assert pm.num_free == 8 - 3 and pm.evictable == {}  # the shared pages are still held
    check_pages(pm, [first, second])
    pm.free(second)
    assert [pm.ref_counts[p] for p in shared] == [0, 0]
    assert list(pm.evictable) == shared[::-1] and pm.num_free == 8
    check_pages(pm, [first, second])


def test_two_running_sequences_share_pages_until_both_finish():
    core = make_core(num_pages=8, page_size=4, budget=100)
    pm = core.pages
    a = make_seq(9, max_tokens=3, request_id="a")
    core.add(a)
    assert core.step().order == [("a", 9)]  # 3 pages, the first 2 full and hashed
    shared = a.table.pages[:2]
    b = make_seq(9, max_tokens=4, prefix=a.prompt_token_ids[:8], request_id="b")
    core.add(b)
    assert core.step().order == [("a", 1), ("b", 1)]  # b computes only its 9th token
    assert b.table.pages[:2] == shared and [pm.ref_counts[p] for p in shared] == [2, 2]
    assert pm.num_free == 8 - 3 - 1
    step = core.step()
    assert step.finished == ["a"]  # b still holds the shared pages
    assert [pm.ref_counts[p] for p in shared] == [1, 1]
    assert not set(shared) & (set(pm.free_pages) | set(pm.evictable))
    assert pm.num_free == 8 - 3 and len(pm.evictable) == 0  # a's third page was never full
    core.check()
    core.run()
    assert [pm.ref_counts[p] for p in shared] == [0, 0]
    assert set(shared) <= set(pm.evictable) and pm.num_free == 8
    core.check()


def test_cached_free_pages_are_evicted_least_recently_used_first_a_tables_tail_first():
    pm = make_pages(4, 2)
    x_toks, y_toks = tokens(4), tokens(2)
    x, y = computed(pm, x_toks), computed(pm, y_toks)  # x: pages 0, 1; y: page 2
    hx, hy = page_hashes(x_toks, 2), page_hashes(y_toks, 2)
    pm.free(x)
    pm.free(y)
    assert list(pm.evictable) == [1, 0, 2] and pm.free_pages == [3]
    touch = PageTable()
    assert pm.match_prefix(touch, [*x_toks[:2], *tokens(1)]) == 2  # x's first page, again
    pm.free(touch)
    assert list(pm.evictable) == [1, 2, 0]
    pm.drain_events()
    big = PageTable()
    assert pm.allocate(big, 5)  # 3 pages: the free one, then the two least recently used
    assert big.pages == [1, 2, 3] and list(pm.evictable) == [0]  # handed out ascending
    assert pm.drain_events() == [KVEvent("evicted", hx[1]), KVEvent("evicted", hy[0])]
    assert pm.hash_to_page == {hx[0]: 0}
    check_pages(pm, [big])
    assert pm.allocate(big, 8) and big.pages == [1, 2, 3, 0]
    assert pm.drain_events() == [KVEvent("evicted", hx[0])] and pm.hash_to_page == {}
    assert pm.page_hash == [None] * 4
    pm.free(big)
    assert pm.match_prefix(PageTable(), [*x_toks, 7]) == 0  # forgotten
    check_pages(pm, [big])


def runs(pages: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in itertools.pairwise(pages))


def test_a_long_prompts_evicted_pages_come_back_as_one_ascending_run():
    # A table's tail is evicted first, so evicted pages come off the LRU reversed; handed out
    # lowest first, a later long prompt gets one run (one extent per layer for a KV transfer).
    pm = make_pages(8, 2)
    old = computed(pm, tokens(16))
    assert old.pages == list(range(8))
    pm.free(old)
    assert list(pm.evictable) == [7, 6, 5, 4, 3, 2, 1, 0]
    new = PageTable()
    assert pm.allocate(new, 12)
    assert new.pages == [1, 2, 3, 4, 5, 6]  # 6 evicted, and 1 more of the run (evict_batch)
    assert list(pm.evictable) == [0]
    check_pages(pm, [new])


def test_a_prompt_allocated_chunk_by_chunk_reuses_an_old_prompts_pages_in_few_runs():
    pm = make_pages(320, 1)  # evict_batch 40
    old, rest = computed(pm, tokens(40)), computed(pm, tokens(280))
    assert old.pages == list(range(40))
    pm.free(old)
    pm.free(rest)
    assert not pm.free_pages
    new = PageTable()
    for n in range(4, 41, 4):  # a chunked prefill: 4 pages a step
        assert pm.allocate(new, n)
    assert sorted(new.pages) == list(range(40))
    # Evicting only what each chunk lacks would give 10 reversed runs of 4.
    assert runs(new.pages) <= 3
    check_pages(pm, [new, rest])


def test_the_same_prefix_computed_twice_keeps_one_cached_copy():
    pm = make_pages(8, 4)
    toks = tokens(8)
    first, second = computed(pm, toks), computed(pm, toks)  # concurrently: no match between
    assert first.hashes == second.hashes == page_hashes(toks, 4)
    assert pm.hash_to_page == dict(zip(first.hashes, first.pages))
    assert [pm.page_hash[p] for p in second.pages] == [None, None]  # a private copy
    assert [e.kind for e in pm.drain_events()] == ["stored", "stored"]
    private, cached = list(second.pages), list(first.pages)
    pm.free(second)
    assert pm.evictable == {} and set(private) <= set(pm.free_pages)
    pm.free(first)
    assert list(pm.evictable) == cached[::-1]
    check_pages(pm, [first, second])


def test_with_prefix_caching_off_nothing_is_hashed_or_matched():
    pm = make_pages(4, 4, caching=False)
    toks = tokens(8)
    t = computed(pm, toks)
    assert t.hashes == [] and pm.hash_to_page == {} and pm.drain_events() == []
    pm.free(t)
    assert pm.evictable == {} and len(pm.free_pages) == 4
    assert pm.match_prefix(PageTable(), [*toks, 1]) == 0


def test_reset_prefix_cache_forgets_only_unreferenced_pages():
    pm = make_pages(8, 4)
    held_toks, freed_toks = tokens(8), tokens(4)
    held, freed = computed(pm, held_toks), computed(pm, freed_toks)
    pm.free(freed)
    pm.drain_events()
    pm.reset_prefix_cache()
    assert pm.drain_events() == [KVEvent("evicted", page_hashes(freed_toks, 4)[0])]
    assert set(pm.hash_to_page) == set(page_hashes(held_toks, 4))
    assert pm.evictable == {} and len(pm.free_pages) == 8 - 2
    check_pages(pm, [held, freed])


def test_truncate_releases_the_tail_but_never_a_hashed_page():
    pm = make_pages(8, 4)
    toks = tokens(5)
    t = PageTable()
    assert pm.allocate(t, 12)  # room for 7 speculative tokens: 3 pages
    pm.commit_full_pages(t, toks, 5)
    tail = t.pages[1:]
    pm.truncate(t, 5)
    assert len(t.pages) == 2 and pm.num_free == 6 and pm.ref_counts[tail[1]] == 0
    pm.truncate(t, 4)
    assert len(t.pages) == 1 and pm.num_free == 7
    with pytest.raises(ValueError, match="hashed"):
        pm.truncate(t, 0)
    check_pages(pm, [t])


def test_the_invariant_check_catches_broken_bookkeeping():
    pm = make_pages(6, 4)
    toks = tokens(8)
    a = computed(pm, toks)
    b = PageTable()
    assert pm.match_prefix(b, [*toks, 0]) == 8 and pm.allocate(b, 9)  # shares a's 2 pages
    c = computed(pm, tokens(4))
    pm.free(c)  # one cached free page
    check_pages(pm, [a, b])

    def broken(change) -> None:
        bad = copy.deepcopy(pm)
        change(bad)
        with pytest.raises(AssertionError):
            check_pages(bad, [a, b])

    broken(lambda m: m.ref_counts.__setitem__(a.pages[0], 1))  # a holder not counted
    broken(lambda m: m.ref_counts.__setitem__(b.pages[2], 2))  # a ref nobody holds
    broken(lambda m: m.free_pages.append(a.pages[0]))  # free and referenced
    broken(lambda m: m.evictable.__setitem__(a.pages[1], None))  # cached-free and referenced
    broken(lambda m: m.free_pages.pop())  # a page in no state: lost
    broken(lambda m: m.page_hash.__setitem__(next(iter(m.evictable)), None))  # hash map wrong


def test_random_page_churn_keeps_the_invariants_and_mirrors_its_events():
    """Random lookups, growth and frees over a few shared prefixes in a small pool; after each
    operation the pages add up, and the stored-minus-evicted events name exactly the cache."""
    rng = random.Random(7)
    pm = make_pages(12, 4)
    prefixes = [tokens(9), tokens(6), tokens(13)]
    live: list[tuple[PageTable, list[int], int]] = []  # (table, its tokens, computed)
    mirror: set[int] = set()
    hits = evictions = refused = shared = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.4 or not live:
            toks = [*rng.choice(prefixes)[: rng.randrange(1, 14)], *tokens(rng.randrange(1, 6))]
            t = PageTable()
            hit = pm.match_prefix(t, toks)
            assert hit % 4 == 0 and hit < len(toks) and len(t.pages) == hit // 4
            hits += hit > 0
            if pm.allocate(t, len(toks)):
                pm.commit_full_pages(t, toks, len(toks))
                live.append((t, toks, len(toks)))
            else:
                refused += 1
                pm.free(t)
        elif op < 0.7:
            i = rng.randrange(len(live))
            t, toks, _ = live[i]
            toks = [*toks, *tokens(rng.randrange(1, 6))]
            if pm.allocate(t, len(toks)):
                pm.commit_full_pages(t, toks, len(toks))
                live[i] = (t, toks, len(toks))
        else:
            t, _, _ = live.pop(rng.randrange(len(live)))
            pm.free(t)
        for e in pm.drain_events():
            if e.kind == "stored":
                assert e.page_hash not in mirror
                mirror.add(e.page_hash)
            else:
                evictions += 1
                mirror.remove(e.page_hash)
        assert mirror == set(pm.hash_to_page)
        for t, _, n in live:
            assert len(t.pages) == -(-n // 4) and len(t.hashes) == n // 4
        check_pages(pm, [t for t, _, _ in live])
        shared += any(r > 1 for r in pm.ref_counts)
    assert hits > 300 and evictions > 300 and refused > 100 and shared > 300
