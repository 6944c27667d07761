"""The NIXL transport between two real agents in two processes: pages written from one pool
into chosen pages of the other, the notification after them, and a dead peer."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from common.kv_layout import KVLayout
from services.executor.kv_transport import KVTransport, TransferError
from tools.bench.kv_probe import KINDS

LAYERS, PAGES, PAGE_BYTES = 3, 8, 4096


def pool(fill: int | None = None) -> tuple[list[np.ndarray], KVLayout]:
    layers = [np.zeros(PAGES * PAGE_BYTES, dtype=np.uint8) for _ in range(LAYERS)]
    if fill is not None:  # byte = layer * 16 + page: every page of every layer is distinct
        for layer, buf in enumerate(layers):
            buf[:] = np.repeat(np.arange(PAGES, dtype=np.uint8) + 16 * layer + fill, PAGE_BYTES)
    layout = KVLayout(tuple(b.ctypes.data for b in layers), PAGE_BYTES, PAGES)
    return layers, layout


def receiver(to_parent: Any, from_parent: Any) -> None:
    layers, layout = pool()
    transport = KVTransport("decode-agent", layout)
    to_parent.put((transport.metadata, layout))
    order = from_parent.get()
    if order == "die":
        return
    while True:  # one reply per notification (each is one write), until told to stop
        if order == "go, but look away":
            time.sleep(3)  # a decode side busy elsewhere: nothing moves UCX here meanwhile
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got = transport.notifications()
            time.sleep(0.001)
        to_parent.put((got, [bytes(b) for b in layers]))
        order = from_parent.get()
        if order == "bye":
            return


@pytest.fixture
def peer():
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(to_parent, from_parent), daemon=True)
    proc.start()
    metadata, layout = to_parent.get(timeout=60)
    yield proc, metadata, layout, to_parent, from_parent
    proc.kill()
    proc.join(10)


def test_a_write_lands_in_the_chosen_pages_of_another_process(peer):
    _, metadata, dst_layout, to_parent, from_parent = peer
    _src, src_layout = pool(fill=1)  # held: the agent writes from these buffers
    transport = KVTransport("prefill-agent", src_layout)
    name = transport.add_peer(metadata)
    assert name == "decode-agent"
    from_parent.put("go")
    src_pages, dst_pages = [1, 2, 5], [3, 4, 0]
    result = transport.write(name, src_pages, dst_layout, dst_pages, b"req-1", timeout_s=30)
    assert result.bytes == LAYERS * len(src_pages) * PAGE_BYTES
    assert result.extents == LAYERS * 2  # pages 1,2 -> 3,4 are one run in each layer
    notifications, layers = to_parent.get(timeout=60)
    assert notifications == [b"req-1"]
    for layer in range(LAYERS):
        got = np.frombuffer(layers[layer], dtype=np.uint8).reshape(PAGES, PAGE_BYTES)
        for s, d in zip(src_pages, dst_pages, strict=True):
            assert (got[d] == 1 + 16 * layer + s).all()
        untouched = set(range(PAGES)) - set(dst_pages)
        assert all((got[p] == 0).all() for p in untouched)
    from_parent.put("again")
    # A second write to the same peer goes through the page lists prepared for the first.
    src_pages, dst_pages = [7], [6]
    result = transport.write(name, src_pages, dst_layout, dst_pages, b"req-2", timeout_s=30)
    assert result.bytes == LAYERS * PAGE_BYTES and result.extents == LAYERS
    notifications, layers = to_parent.get(timeout=60)
    assert notifications == [b"req-2"]
    for layer in range(LAYERS):
        got = np.frombuffer(layers[layer], dtype=np.uint8).reshape(PAGES, PAGE_BYTES)
        assert (got[6] == 1 + 16 * layer + 7).all() and (got[3] == 1 + 16 * layer + 1).all()
    from_parent.put("bye")


def test_a_write_completes_while_the_receiver_looks_away(peer):
    """The writer's transfer does not wait for the receiver to poll (the notification goes
    through shared memory, not TCP); the notification is there when it looks."""
    _, metadata, dst_layout, to_parent, from_parent = peer
    _src, src_layout = pool(fill=1)
    transport = KVTransport("prefill-agent-4", src_layout)
    name = transport.add_peer(metadata)
    from_parent.put("go, but look away")
    started = time.monotonic()
    transport.write(name, [0, 1], dst_layout, [2, 3], b"req-3", timeout_s=2.5)
    assert time.monotonic() - started < 2.5  # the receiver still sleeps (3 s)
    notifications, layers = to_parent.get(timeout=60)
    assert notifications == [b"req-3"]
    assert (np.frombuffer(layers[0], dtype=np.uint8).reshape(PAGES, PAGE_BYTES)[3] == 2).all()
    from_parent.put("bye")


def test_pages_outside_either_pool_are_refused_before_anything_moves(peer):
    _, metadata, dst_layout, _, _ = peer
    _src, src_layout = pool(fill=1)
    transport = KVTransport("prefill-agent-3", src_layout)
    name = transport.add_peer(metadata)
    with pytest.raises(ValueError, match="outside"):
        transport.write(name, [0], dst_layout, [PAGES], b"bad", timeout_s=5)
    with pytest.raises(ValueError, match="2 source pages for 1"):
        transport.write(name, [0, 1], dst_layout, [0], b"bad", timeout_s=5)


def test_an_idle_agent_burns_no_cpu():
    """NIXL's own progress thread spins (a core per agent); the transport runs without it."""
    _bufs, layout = pool()
    transport = KVTransport("idle-agent", layout)
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(1.0)
    share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    assert share < 0.2, f"an idle agent used {share:.0%} of a core"
    transport.close()


def test_a_write_to_a_dead_peer_fails_clearly(peer):
    proc, metadata, dst_layout, _, from_parent = peer
    _src, src_layout = pool(fill=1)
    transport = KVTransport("prefill-agent-2", src_layout)
    name = transport.add_peer(metadata)
    from_parent.put("die")
    proc.join(30)
    assert proc.exitcode is not None
    started = time.monotonic()
    with pytest.raises(TransferError, match=name):
        transport.write(name, [0], dst_layout, [0], b"late", timeout_s=5)
    assert time.monotonic() - started < 10


def test_the_probe_times_every_kind_and_sees_every_notification():
    """``tools.bench.kv_probe`` end to end on small sizes (one pair of processes)."""
    cmd = [sys.executable, "-m", "tools.bench.kv_probe", "--one", "--repeat", "2",
           "--sizes-mb", "0.1,2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1])
    assert [round(row["mb"], 2) for row in results["sizes"]] == [0.74, 1.47]  # whole pages, >= 1
    for row in results["sizes"]:
        assert set(KINDS) <= set(row) and all(len(row[k]) == 2 for k in KINDS)
    kinds_with_notes = len(results["sizes"]) * 4 * 3  # raw, ours x2, unprepared; 3 writes each
    assert results["notified"] == f"{kinds_with_notes}/{kinds_with_notes}"
    assert results["idle_cpu"] < 0.2
