"""The scheduler's rules without a model: computed tokens catch up with the target within a
token budget, decodes (running sequences) first, then new prompts, chunked when the budget is
short; prefix hits start at the cached length; the newest running sequence is preempted when
pages run out, and recomputed later. Every number asserted follows from the rule named."""

from __future__ import annotations

import random

from tests.core_helpers import KVEvent, SeqStatus, Sequence, make_core, make_seq, page_hashes


def test_decodes_take_the_budget_first_and_a_new_prompt_gets_the_rest_in_chunks():
    core = make_core(budget=8)
    a = make_seq(5, max_tokens=10, request_id="a")
    core.add(a)
    assert core.step().order == [("a", 5)]
    b = make_seq(20, request_id="b")
    core.add(b)
    # a's decode (1 token) goes first every step; b's 20-token prompt fills the other 7.
    for computed in (7, 14):
        step = core.step()
        assert step.order == [("a", 1), ("b", 7)]
        assert step.sampled == ["a"]  # b's chunk is not its last: no token for b
        assert b.num_computed == computed and b.output_token_ids == []
    step = core.step()
    assert step.order == [("a", 1), ("b", 6)]
    assert step.sampled == ["a", "b"] and b.num_computed == 20
    assert core.step().order == [("a", 1), ("b", 1)]


def test_decodes_that_use_the_whole_budget_leave_prompts_waiting_without_pages():
    core = make_core(budget=2)
    a, b, c = (make_seq(1, request_id=r) for r in "abc")
    core.add(a, b, c)
    for _ in range(3):
        assert core.step().order == [("a", 1), ("b", 1)]
        assert list(core.sched.waiting) == [c]
        assert c.num_computed == 0 and c.table.pages == []


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_over_steps():
    core = make_core(page_size=4, budget=4)
    s = make_seq(10, max_tokens=2, request_id="s")
    core.add(s)
    # (tokens scheduled, computed after, pages held, full pages hashed, outputs)
    expected = [(4, 4, 1, 1, 0), (4, 8, 2, 2, 0), (2, 10, 3, 2, 1), (1, 11, 3, 2, 2)]
    for num_new, computed, pages, hashed, outputs in expected:
        step = core.step()
        assert step.order == [("s", num_new)]
        if outputs < 2:  # (after the last step it is finished and its table is empty)
            assert s.num_computed == computed and len(s.table.pages) == pages
            assert len(s.table.hashes) == hashed
        assert len(s.output_token_ids) == outputs
    assert step.finished == ["s"] and core.pages.num_free == core.pages.num_pages


def test_a_chunk_in_flight_is_continued_before_the_next_prompt_is_admitted():
    core = make_core(budget=4)
    a, b = make_seq(6, request_id="a"), make_seq(6, request_id="b")
    core.add(a, b)
    assert core.step().order == [("a", 4)]  # b is not admitted: the budget is spent
    assert list(core.sched.waiting) == [b]
    assert core.step().order == [("a", 2), ("b", 2)]  # a's last chunk, then b's first
    assert core.step().order == [("a", 1), ("b", 3)]
    step = core.step()
    assert step.order == [("a", 1), ("b", 1)] and step.sampled == ["a", "b"]


def test_max_num_seqs_caps_the_running_sequences():
    core = make_core(budget=100, max_seqs=2)
    a = make_seq(3, max_tokens=1, request_id="a")
    b = make_seq(3, max_tokens=3, request_id="b")
    c = make_seq(3, max_tokens=2, request_id="c")
    core.add(a, b, c)
    step = core.step()
    assert step.order == [("a", 3), ("b", 3)] and step.finished == ["a"]
    assert list(core.sched.waiting) == [c] and c.table.pages == []
    assert core.step().order == [("b", 1), ("c", 3)]  # a's seat went to c
    step = core.step()
    assert step.order == [("b", 1), ("c", 1)] and step.finished == ["b", "c"]


# -- prefix cache ---------------------------------------------------------------------------


def finished_donor(core, prompt_len: int):
    """Run one request to completion so its full prompt pages stay in the prefix cache."""
    donor = make_seq(prompt_len, max_tokens=1)
    core.add(donor)
    core.run()
    return donor


def test_a_prefix_hit_starts_computing_at_the_cached_full_pages():
    core = make_core(page_size=4)
    donor = finished_donor(core, 10)  # pages [0..3], [4..7] full and hashed; [8, 9] is not
    assert core.pages.queries == 10 and core.pages.hits == 0
    b = make_seq(15, prefix=donor.prompt_token_ids, request_id="b")
    c = make_seq(15, prefix=donor.prompt_token_ids[:6], request_id="c")  # 1 full page + 2
    core.add(b, c)
    step = core.step()
    assert step.order == [("b", 15 - 8), ("c", 15 - 4)]
    assert (b.num_cached_prompt_tokens, c.num_cached_prompt_tokens) == (8, 4)
    assert core.pages.queries == 10 + 15 + 15 and core.pages.hits == 8 + 4
    cached = [core.pages.hash_to_page[h] for h in page_hashes(donor.prompt_token_ids[:8], 4)]
    assert b.table.pages[:2] == cached and c.table.pages[:1] == cached[:1]
    assert core.pages.ref_counts[cached[0]] == 2 and core.pages.ref_counts[cached[1]] == 1


def test_a_fully_cached_prompt_still_computes_at_least_one_token():
    core = make_core(page_size=4)
    eight = finished_donor(core, 8)  # both pages full and hashed
    nine = finished_donor(core, 9)  # two full pages and one token
    again8 = make_seq(8, prefix=eight.prompt_token_ids, request_id="again8")
    again9 = make_seq(9, prefix=nine.prompt_token_ids, request_id="again9")
    core.add(again8, again9)
    hits = core.pages.hits
    # 8 tokens: the last one must be computed, and only full pages are matched, so the whole
    # second page is recomputed; 9 tokens: both full pages hit, the ninth token is computed.
    assert core.step().order == [("again8", 4), ("again9", 1)]
    assert core.pages.hits - hits == 4 + 8
    assert again8.output_token_ids and again9.output_token_ids  # both sampled this step


def test_prefix_caching_off_computes_every_prompt_from_zero():
    core = make_core(page_size=4, caching=False)
    donor = finished_donor(core, 10)
    again = make_seq(10, prefix=donor.prompt_token_ids, request_id="again")
    core.add(again)
    assert core.step().order == [("again", 10)]
    assert core.pages.hits == 0 and core.pages.hash_to_page == {}


def test_a_request_waiting_for_pages_is_counted_once_in_the_hit_rate():
    core = make_core(num_pages=4, page_size=4, budget=100)
    donor = finished_donor(core, 5)  # one full page cached
    hog = make_seq(11, max_tokens=2, request_id="hog")  # 3 pages, the 3 free ones
    core.add(hog)
    core.step()
    late = make_seq(9, prefix=donor.prompt_token_ids[:4], request_id="late")  # needs 3 pages
    core.add(late)
    assert core.step().order == [("hog", 1)] and list(core.sched.waiting) == [late]
    assert core.step().order == [("late", 5)]  # hog finished: 1 page hit + 2 fresh ones
    assert late.num_cached_prompt_tokens == 4
    assert core.pages.queries == 5 + 11 + 9 and core.pages.hits == 4


# -- preemption -----------------------------------------------------------------------------


def test_preemption_takes_the_newest_sequence_which_resumes_later_from_its_cached_pages():
    core = make_core(num_pages=4, page_size=4, budget=100)
    a = make_seq(6, max_tokens=6, request_id="a")  # ends at 12 tokens: 3 pages
    b = make_seq(6, max_tokens=5, request_id="b")
    c = make_seq(4, max_tokens=1, request_id="c")
    core.add(a, b)
    assert core.step().order == [("a", 6), ("b", 6)]  # 2 pages each: the pool is full
    assert core.pages.num_free == 0
    core.add(c)  # it waits for a page
    for _ in range(2):  # the 7th and 8th tokens still fit in 2 pages
        assert core.step().order == [("a", 1), ("b", 1)]
    b_hashes = page_hashes(b.all_token_ids[:8], 4)
    step = core.step()  # a's 9th token needs a 3rd page: b, the newer, gives up its two
    assert step.preempted == ["b"] and step.order == [("a", 1)]
    assert b.status is SeqStatus.WAITING and b.num_preemptions == 1
    assert (core.sched.num_preempted_for_pages, core.sched.num_guests_yielded) == (1, 0)
    assert b.num_computed == 0 and b.table.pages == []
    assert list(core.sched.waiting) == [b, c]  # back at the head of the queue
    assert core.sched.running == [a] and len(a.table.pages) == 3
    # Both of b's pages were full and cached; a's new page evicted b's last page (a sequence's
    # pages are queued tail first), so b's first page is still cached.
    assert core.pages.drain_events()[-1] == KVEvent("evicted", b_hashes[1])
    assert list(core.pages.evictable) == [core.pages.hash_to_page[b_hashes[0]]]
    assert core.pages.num_free == 1
    for _ in range(2):  # b needs 3 pages for its 9 tokens, 1 is free: it waits, c behind it
        assert core.step().order == [("a", 1)]
    assert "a" not in core.live  # a made its 6 tokens
    step = core.step()  # b: 6 prompt + 3 output tokens, the first page from the cache
    assert step.order == [("b", 9 - 4), ("c", 4)] and step.sampled == ["b", "c"]
    step = core.step()
    assert step.order == [("b", 1)] and step.finished == ["b"]
    assert len(a.output_token_ids) == 6 and len(b.output_token_ids) == 5
    # A recomputed prefix is not a cache hit in the metrics, nor a second query.
    assert b.num_cached_prompt_tokens == 0
    assert core.pages.queries == 6 + 6 + 4 and core.pages.hits == 0
    assert core.pages.num_free == 4


def test_the_newest_sequence_short_of_a_page_preempts_itself():
    core = make_core(num_pages=2, page_size=4, budget=100)
    a = make_seq(3, max_tokens=3, request_id="a")
    b = make_seq(4, max_tokens=3, request_id="b")
    core.add(a, b)
    assert core.step().order == [("a", 3), ("b", 4)]
    step = core.step()  # a's 4th token fits its page; b's 5th needs a second page
    assert step.order == [("a", 1)] and step.preempted == ["b"]
    assert b.num_computed == 0 and b.table.pages == []
    step = core.step()  # a grows into b's cached page, evicting it
    assert step.order == [("a", 1)] and step.finished == ["a"]
    assert [e.kind for e in core.pages.drain_events()] == ["stored", "stored", "evicted"]
    step = core.step()  # so b recomputes its 5 tokens from zero
    assert step.order == [("b", 5)] and b.num_computed == 5
    core.run()
    assert len(b.output_token_ids) == 3 and core.pages.num_free == 2


def test_a_request_that_cannot_be_admitted_holds_no_pages_while_it_waits():
    """Its matched prefix is let go: held, it could lock out a sequence preempted ahead of it
    (nothing running, and neither finding the pages it needs: every step idle)."""
    core = make_core(num_pages=4, page_size=2, budget=100)
    donor = finished_donor(core, 3)  # its first page ([0, 1]) stays cached
    cached = core.pages.hash_to_page[page_hashes(donor.prompt_token_ids[:2], 2)[0]]
    a = make_seq(5, max_tokens=10, request_id="a")
    core.add(a)
    assert core.step().order == [("a", 5)]  # 3 pages; the cached page is the last one free
    b = make_seq(5, max_tokens=3, prefix=donor.prompt_token_ids[:2], request_id="b")
    core.add(b)
    assert core.step().order == [("a", 1)]  # b would hit the cached page but needs 2 more
    assert list(core.sched.waiting) == [b] and b.table.pages == [] and b.num_computed == 0
    assert core.pages.ref_counts[cached] == 0 and list(core.pages.evictable) == [cached]
    results = core.run(max_steps=50)
    assert all(r.scheduled for r in results)  # no idle step
    assert len(a.output_token_ids) == 3  # 8 tokens fill the pool (max_seq_len)
    assert len(b.output_token_ids) == 3 and core.pages.num_free == 4


# -- abort ----------------------------------------------------------------------------------


def test_aborting_a_running_or_waiting_sequence_frees_its_pages():
    core = make_core(num_pages=8, page_size=4, budget=100, max_seqs=2)
    a = make_seq(9, request_id="a")  # 3 pages, 2 of them full
    b = make_seq(8, prefix=a.prompt_token_ids[:4], request_id="b")
    waiting = make_seq(4, request_id="waiting")
    core.add(a, b, waiting)
    assert core.step().order == [("a", 9), ("b", 8)]  # b computed its own copy of page 0
    assert core.pages.num_free == 8 - 3 - 2
    core.abort(a)
    assert core.sched.running == [b] and a.table.pages == []
    assert core.pages.num_free == 8 - 2 and len(core.pages.evictable) == 2  # a's full pages
    core.check()
    core.abort(waiting)  # never admitted: it held nothing, and it is gone from the queue
    assert list(core.sched.waiting) == [] and core.pages.num_free == 6
    late = make_seq(9, prefix=a.prompt_token_ids[:8], request_id="late")
    core.add(late)
    assert core.step().order == [("b", 1), ("late", 1)]  # a's cached pages served late
    hit = list(late.table.pages[:2])
    assert [core.pages.ref_counts[p] for p in hit] == [1, 1]
    core.abort(late)
    assert [core.pages.ref_counts[p] for p in hit] == [0, 0]
    core.abort(b)
    assert core.pages.num_free == 8 and all(r == 0 for r in core.pages.ref_counts)
    core.check()


def test_aborting_a_request_refused_pages_leaves_the_shared_prefix_to_its_holder():
    core = make_core(num_pages=4, page_size=4, budget=100)
    a = make_seq(9, max_tokens=8, request_id="a")  # 3 pages of the 4, 2 of them full
    core.add(a)
    core.step()
    b = make_seq(16, prefix=a.prompt_token_ids[:8], request_id="b")  # 2 hits + 2 pages: no
    core.add(b)
    assert core.step().order == [("a", 1)] and list(core.sched.waiting) == [b]
    shared = [core.pages.hash_to_page[h] for h in page_hashes(a.prompt_token_ids[:8], 4)]
    assert shared == a.table.pages[:2]
    core.abort(b)
    assert [core.pages.ref_counts[p] for p in shared] == [1, 1]  # a's references only
    assert b.table.pages == [] and core.pages.num_free == 1
    core.check()


# -- churn ----------------------------------------------------------------------------------


def test_random_churn_keeps_every_invariant_after_every_step():
    """Random arrivals (half of them sharing one of two prefixes), lengths and aborts in a
    pool small enough to preempt and evict; after every step the pages add up, and every
    scheduled chunk respects the budget, the seat cap and the catch-up rule."""
    rng = random.Random(1234)
    num_pages, page_size, budget, max_seqs = 12, 4, 16, 6
    core = make_core(num_pages, page_size, budget, max_seqs)
    prefixes = [make_seq(10).prompt_token_ids, make_seq(7).prompt_token_ids]
    submitted: list[Sequence] = []
    aborted = preemptions = evictions = 0
    for _ in range(20_000):
        if len(submitted) >= 400 and not core.live:
            break
        for _ in range(rng.randrange(0, 3)):
            if len(submitted) < 400:
                prefix = rng.choice(prefixes) if rng.random() < 0.5 else []
                length = len(prefix) + rng.randrange(1, 20)
                submitted.append(make_seq(length, rng.randrange(1, 12), prefix))
                core.add(submitted[-1])
        if core.live and rng.random() < 0.1:
            core.abort(rng.choice(list(core.live.values())))
            aborted += 1
        running = {s.request_id: s.num_computed for s in core.sched.running}
        step = core.step()
        assert step.plan.num_tokens <= budget
        assert len(step.scheduled) == len(step.plan.scheduled)  # no sequence twice
        for item in step.plan.scheduled:
            seq, rid = item.seq, item.seq.request_id
            assert item.num_new >= 1
            start = seq.num_computed - item.num_new
            if rid in running:  # computed tokens catch up from where they were
                assert start == running[rid]
            else:  # admitted at a prefix hit: whole pages, and at least one token computed
                assert start % page_size == 0
            assert seq.num_computed <= seq.num_tokens  # never past the target
        for seq in step.plan.preempted:
            assert seq.num_computed == 0 and seq.table.pages == []
            assert seq.status is SeqStatus.WAITING and seq in core.sched.waiting
        preemptions += len(step.preempted)
        evictions += sum(e.kind == "evicted" for e in core.pages.drain_events())
        core.check()
        assert all(s.table.pages == [] for s in core.sched.waiting)
        assert step.scheduled or not core.live  # never an idle step with work left
    else:
        raise AssertionError("the scheduler stopped making progress")
    assert all(r == 0 for r in core.pages.ref_counts)
    assert core.pages.num_free == num_pages
    finished = [s for s in submitted if s.finish_reason == "length"]
    assert len(finished) + aborted == len(submitted)
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in finished)
    # the churn did what it is for
    assert preemptions > 50 and evictions > 500 and core.pages.hits > 200 and aborted > 50


def guest_seq(prompt_len: int, request_id: str, max_tokens: int = 16) -> Sequence:
    seq = make_seq(prompt_len, max_tokens=max_tokens, request_id=request_id)
    seq.guest = True  # spilled in from another region (the executor sets it from the wire)
    return seq


def test_a_full_batch_preempts_its_newest_guest_for_an_own_request():
    core = make_core(budget=64, max_seqs=3)
    g1, g2 = guest_seq(4, "g1"), guest_seq(4, "g2")
    own = make_seq(4, request_id="own")
    core.add(g1, g2, own)
    # own goes first (guests wait behind own requests), then the guests in their order
    assert core.step().order == [("own", 4), ("g1", 4), ("g2", 4)]
    late = make_seq(4, request_id="late")  # an own request while the batch is full
    core.add(late)
    step = core.step()
    # g2 (the newest guest) gives its slot up; late is in this very step, prompt and all.
    assert step.preempted == ["g2"]
    assert step.order == [("own", 1), ("g1", 1), ("late", 4)]
    assert g2.num_computed == 0 and g2.table.pages == [] and g2.num_preemptions == 1
    assert (core.sched.num_preempted_for_pages, core.sched.num_guests_yielded) == (0, 1)
    assert len(g2.output_token_ids) == 1  # its streamed token stays; it is recomputed
    assert list(core.sched.waiting) == [g2]
    core.check()


def test_guests_wait_behind_own_requests_and_resume_when_a_slot_frees():
    core = make_core(budget=64, max_seqs=2)
    g = guest_seq(4, "g", max_tokens=3)
    a = make_seq(4, max_tokens=3, request_id="a")
    core.add(g, a)
    core.step()
    b, later_guest = make_seq(4, max_tokens=2, request_id="b"), guest_seq(4, "g2")
    core.add(later_guest, b)  # the guest arrived first; b still goes first
    assert core.step().preempted == ["g"]
    assert [s.request_id for s in core.sched.waiting] == ["g", "g2"]
    results = core.run()
    finished = [rid for r in results for rid in r.finished]
    assert finished[:2] == ["a", "b"] and sorted(finished[2:]) == ["g", "g2"]
    assert len(g.output_token_ids) == 3  # one before its preemption, two after
    assert core.pages.num_free == core.pages.num_pages


def test_nothing_is_preempted_for_a_guest_nor_when_no_guest_runs():
    core = make_core(budget=64, max_seqs=2)
    a, b = make_seq(4, request_id="a"), make_seq(4, request_id="b")
    core.add(a, b)
    core.step()
    core.add(make_seq(4, request_id="c"), guest_seq(4, "g"))  # own ones hold the batch
    assert core.step().preempted == []
    core2 = make_core(budget=64, max_seqs=2)
    core2.add(guest_seq(4, "g1"), guest_seq(4, "g2"))
    core2.step()
    core2.add(guest_seq(4, "g3"))  # a guest never preempts another guest
    step = core2.step()
    assert step.preempted == [] and step.order == [("g1", 1), ("g2", 1)]
