"""The NIXL transport between two real agents in two processes: pages written from one pool
into chosen pages of the other, the notification after them, and a dead peer."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np
import pytest

from common.kv_layout import KVLayout
from services.executor.kv_transport import KVTransport, TransferError

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
    if from_parent.get() == "die":
        return
    got: list[bytes] = []
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        got = transport.notifications()
        time.sleep(0.001)
    to_parent.put((got, [bytes(b) for b in layers]))
    from_parent.get()


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
    from_parent.put("bye")


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
