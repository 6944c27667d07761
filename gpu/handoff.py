"""Disaggregated prefill and decode, the engine's side: a sequence's prompt KV computed by one
engine and continued by another.

Decode side: ``reserve`` takes pages for a prompt before anyone computes it (their ids go to
the prefill side, which writes the prompt's KV straight into them); ``admit_prefilled`` then
puts the sequence in the running batch with every prompt token computed and the first token
(sampled by the prefill side) appended, so its next step decodes token two. ``engine.abort``
releases a reservation that never completes.

Prefill side: the request runs like any other until it has sampled its first token;
``detach_prefilled`` then takes it out of the engine while its pages stay held (they are the
transfer's source) until ``release``. Its full prompt pages stay in the prefix cache.

How the bytes move (NIXL, or ``KVCache.export_pages``/``import_pages`` in one process) is not
this module's business; the pages of every layer are at ``KVCache.layout()``.
"""

from __future__ import annotations

from gpu.engine import Engine
from gpu.page_manager import PageTable
from gpu.sampling_params import SamplingParams, skip_draws
from gpu.sequence import SeqStatus


def reserve(
    engine: Engine,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    guest: bool = False,
    lora: str = "",
) -> list[int] | None:
    """Pages for this prompt's KV, in order (page ``i`` holds tokens ``i*page_size...``), or
    None when the pool or the batch has no room now. Raises like ``add_request`` on a bad
    request. The pages are fresh: nothing of the prompt is taken from the local cache (the
    prefill side writes every page). ``guest`` as for ``add_request``: once admitted, the
    sequence yields its slot to an own request like any guest (recomputed here, prompt and
    all, when a slot frees)."""
    seq = engine.new_sequence(request_id, prompt_token_ids, params, lora=lora)
    seq.guest = guest
    seq.prompt_scoring = None  # the prefill side scores the prompt and sends them
    seq.pooling = None  # (and pools it, for an embedding)
    # The pages may have been freed while a step still writes to them (a step runs on after
    # its call returns); the prefill side's writes do not queue behind it on the stream.
    engine.settle_device()
    # Room for the first decode token too, so an admitted sequence never preempts at once.
    if not engine.pages.can_allocate(seq.table, len(prompt_token_ids) + 1):
        return None
    if len(engine.scheduler.running) + len(engine.reserved) >= engine.config.max_num_seqs:
        return None
    engine.pages.allocate(seq.table, len(prompt_token_ids))
    engine.reserved[request_id] = seq
    return list(seq.table.pages)


def admit_prefilled(engine: Engine, request_id: str, first_token: int) -> bool:
    """The reserved pages now hold the prompt's KV: run the sequence from its second token.
    False if the reservation is gone (aborted meanwhile)."""
    seq = engine.reserved.pop(request_id, None)
    if seq is None:
        return False
    engine.runner.check_token_ids([first_token])
    seq.num_computed = len(seq.prompt_token_ids)
    seq.output_token_ids = [first_token]
    if seq.generator is not None and not seq.params.is_greedy:
        skip_draws(seq.generator, 1, engine.runner.config.vocab_size)  # the prefill side's draw
    # Full prompt pages become this pool's prefix cache too (and KV events tell the index).
    engine.pages.commit_full_pages(seq.table, seq.all_token_ids, seq.num_computed)
    seq.status = SeqStatus.RUNNING
    seq.admitted = True
    engine.seqs[request_id] = seq
    engine.scheduler.running.append(seq)
    return True


def withdraw(engine: Engine, request_id: str) -> PageTable | None:
    """End a reservation but keep its pages held: the prefill side may still be writing into
    them (a slow transfer, an abort that crossed it). ``release`` them once it cannot."""
    seq = engine.reserved.pop(request_id, None)
    return seq.table if seq is not None else None


def detach_prefilled(engine: Engine, request_id: str) -> tuple[PageTable, int] | None:
    """Take a sequence that has just sampled its first token out of the engine, keeping its
    pages: (its page table, prompt tokens). Call ``release`` when they have been copied."""
    seq = engine.seqs.get(request_id)
    if seq is None or seq.is_finished or len(seq.output_token_ids) != 1:
        return None
    del engine.seqs[request_id]
    engine.scheduler.running.remove(seq)
    seq.status = SeqStatus.FINISHED
    prompt = len(seq.prompt_token_ids)
    # The table covers the prompt; a page allocated past it (none today) is not sent.
    engine.pages.truncate(seq.table, prompt)
    return seq.table, prompt


def release(engine: Engine, table: PageTable) -> None:
    """Give back a detached sequence's pages (full ones stay cached)."""
    engine.pages.free(table)
