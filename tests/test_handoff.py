"""Disaggregation's engine side: a prompt computed by one engine, its KV pages copied into
pages another engine reserved, decoded there; equal to one engine's and transformers' output."""

from __future__ import annotations

import ctypes

import pytest

from common.kv_layout import KVLayout, paired_extents
from gpu import handoff
from gpu.engine import Engine
from gpu.sampling_params import SamplingParams
from tests.test_engine import GREEDY, hf_greedy, make_engine, oracle, prompts_for  # noqa: F401


def prefill_elsewhere(
    prefill: Engine, decode: Engine, rid: str, prompt: list[int], params: SamplingParams, copy
) -> list[int]:
    """The disaggregated path, in one process: returns every output token of the request."""
    pages = handoff.reserve(decode, rid, prompt, params)
    assert pages is not None
    prefill.add_request(rid, prompt, params)
    first: list[int] = []
    while not first:
        first = [t for out in prefill.step() if out.request_id == rid for t in out.new_token_ids]
    detached = handoff.detach_prefilled(prefill, rid)
    assert detached is not None
    table, num_prompt = detached
    assert num_prompt == len(prompt) and len(table.pages) == len(pages)
    copy(prefill, table.pages, decode, pages)
    handoff.release(prefill, table)
    assert handoff.admit_prefilled(decode, rid, first[0])
    out = list(first)
    while decode.has_unfinished():
        out += [t for o in decode.step() if o.request_id == rid for t in o.new_token_ids]
    return out


def copy_tensors(src: Engine, src_pages: list[int], dst: Engine, dst_pages: list[int]) -> None:
    dst.runner.kv.import_pages(dst_pages, src.runner.kv.export_pages(src_pages))


def copy_bytes(src: Engine, src_pages: list[int], dst: Engine, dst_pages: list[int]) -> None:
    """What the NIXL write does, done with memmove over the same extents."""
    ext_src, ext_dst = paired_extents(
        src.runner.kv.layout(), src_pages, dst.runner.kv.layout(), dst_pages
    )
    for (s, n), (d, m) in zip(ext_src, ext_dst, strict=True):
        assert n == m
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("copy", [copy_tensors, copy_bytes], ids=["tensors", "bytes"])
def test_greedy_through_two_engines_equals_one_and_transformers(tiny_llama, oracle, copy):  # noqa: F811
    prompts = prompts_for(3, [5, 17, 33])
    params = SamplingParams(max_tokens=12, **GREEDY)
    mixed = make_engine(tiny_llama).generate(prompts, params)
    prefill, decode = make_engine(tiny_llama), make_engine(tiny_llama)
    # Other pages in use on the decode side, so page ids differ between the two pools.
    decode.add_request("other", prompts_for(9, [21])[0], params)
    decode.step()
    for i, prompt in enumerate(prompts):
        got = prefill_elsewhere(prefill, decode, f"r{i}", prompt, params, copy)
        assert got == mixed[i] == hf_greedy(oracle, prompt, 12)
    assert prefill.pages.num_free == prefill.pages.num_pages  # held only by the cache
    assert decode.pages.num_free == decode.pages.num_pages
    prefill.pages.check_invariants([])
    decode.pages.check_invariants([])


def test_seeded_sampling_through_two_engines_equals_one(tiny_llama):
    prompts = prompts_for(5, [9, 40])
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    mixed = make_engine(tiny_llama).generate(prompts, params)
    prefill, decode = make_engine(tiny_llama), make_engine(tiny_llama)
    got = [
        prefill_elsewhere(prefill, decode, f"s{i}", p, params, copy_tensors)
        for i, p in enumerate(prompts)
    ]
    assert got == mixed


def test_the_prefill_side_keeps_the_prompt_in_its_prefix_cache(tiny_llama):
    prompt = prompts_for(7, [30])[0]
    params = SamplingParams(max_tokens=4, **GREEDY)
    prefill, decode = make_engine(tiny_llama), make_engine(tiny_llama)
    prefill_elsewhere(prefill, decode, "a", prompt, params, copy_tensors)
    prefill_elsewhere(prefill, decode, "b", [*prompt, 5, 6], params, copy_tensors)
    assert prefill.pages.hits == 28  # 7 full pages of 4 tokens the second time
    assert decode.pages.hash_to_page  # the decode pool caches the prompt pages too


def test_an_abandoned_reservation_gives_its_pages_back(tiny_llama):
    decode = make_engine(tiny_llama, num_pages=16)
    params = SamplingParams(max_tokens=4, **GREEDY)
    pages = handoff.reserve(decode, "x", list(range(3, 40)), params)
    assert pages is not None and len(pages) == 10
    assert decode.pages.num_free == 6 and not decode.has_unfinished()
    assert handoff.reserve(decode, "y", list(range(3, 40)), params) is None  # no room
    with pytest.raises(ValueError, match="already in use"):
        handoff.reserve(decode, "x", [3, 4], params)
    assert decode.abort("x")
    assert decode.pages.num_free == 16
    assert not handoff.admit_prefilled(decode, "x", 5)
    decode.pages.check_invariants([])


def test_descriptor_indices_name_pages_of_every_layer_in_the_prepared_list():
    layout = KVLayout((1000, 9000), page_bytes=10, num_pages=5)
    extents = layout.page_extents
    assert len(extents) == 10 and extents[0] == (1000, 10) and extents[7] == (9020, 10)
    assert layout.descriptor_indices([4, 0]) == [4, 0, 9, 5]
    assert [extents[i] for i in layout.descriptor_indices([2])] == [(1020, 10), (9020, 10)]
    with pytest.raises(ValueError, match="outside"):
        layout.descriptor_indices([5])


def test_paired_extents_merge_runs_consecutive_on_both_sides():
    src = KVLayout((1000, 9000), page_bytes=10, num_pages=50)
    dst = KVLayout((50000, 70000), page_bytes=10, num_pages=40)
    s, d = paired_extents(src, [4, 5, 6, 9], dst, [0, 1, 3, 4])
    assert s == [(1040, 20), (1060, 10), (1090, 10), (9040, 20), (9060, 10), (9090, 10)]
    assert d == [(50000, 20), (50030, 10), (50040, 10), (70000, 20), (70030, 10), (70040, 10)]
    with pytest.raises(ValueError, match="outside"):
        paired_extents(src, [4], dst, [40])
    with pytest.raises(ValueError, match="differ"):
        paired_extents(src, [1], KVLayout((0,), 10, 40), [1])


def test_a_guest_admitted_through_a_handoff_yields_its_slot_and_is_recomputed(tiny_llama):
    # A guest (spilled in from another region) whose prompt was prefilled elsewhere is
    # preempted for an own request when the batch is full, like any guest, and recomputed
    # here when the slot frees: its output is the uninterrupted one.
    prompt, own_prompt = prompts_for(11, [13, 9])
    params = SamplingParams(max_tokens=10, **GREEDY)
    expected = make_engine(tiny_llama).generate([prompt], params)[0]
    prefill, decode = make_engine(tiny_llama), make_engine(tiny_llama, max_seqs=1)
    pages = handoff.reserve(decode, "g", prompt, params, guest=True)
    assert pages is not None
    prefill.add_request("g", prompt, params)
    first = [t for out in prefill.step() for t in out.new_token_ids]
    detached = handoff.detach_prefilled(prefill, "g")
    assert detached is not None
    copy_tensors(prefill, detached[0].pages, decode, pages)
    assert handoff.admit_prefilled(decode, "g", first[0])
    out = list(first) + [t for o in decode.step() for t in o.new_token_ids]
    decode.add_request("own", own_prompt, SamplingParams(max_tokens=3, **GREEDY))
    steps = [decode.step() for _ in range(3)]
    assert [{o.request_id for o in step} for step in steps] == [{"own"}] * 3  # the guest waits
    assert [s.request_id for s in decode.scheduler.waiting] == ["g"]
    while decode.has_unfinished():
        out += [t for o in decode.step() if o.request_id == "g" for t in o.new_token_ids]
    assert out == expected
    decode.pages.check_invariants([])


def test_a_reservation_holds_its_slot_in_max_num_seqs(tiny_llama):
    """Local admissions did not count reservations: with max_num_seqs 2, one reservation and
    two local requests ran as three sequences once the prompt's KV arrived."""
    decode = make_engine(tiny_llama, num_pages=64, max_seqs=2)
    params = SamplingParams(max_tokens=8, **GREEDY)
    assert handoff.reserve(decode, "r", [5, 6, 7, 8, 9], params) is not None
    decode.add_request("a", [10, 11, 12], params)
    decode.add_request("b", [13, 14, 15], params)
    decode.step()
    assert [s.request_id for s in decode.scheduler.running] == ["a"]  # b waits for a slot
    assert handoff.admit_prefilled(decode, "r", 20)
    while decode.has_unfinished():
        assert len(decode.scheduler.running) <= 2
        decode.step()
