"""The bytes of disaggregated prefill: KV pages written from this process's pool straight into
another executor's with NIXL (UCX underneath: CMA between processes on one host, RDMA between
hosts, CUDA IPC or NVLink for GPU memory).

Each executor of role prefill or decode makes one agent, named after its id and process
incarnation (a restarted executor is a new agent, never confused with the old one), registers
its whole KV pool with it once at start and prepares, also once, a descriptor list with one
entry per page of every layer. A decode executor hands out its agent metadata (once per peer:
the prefill side asks for it the first time it writes there) and, per request, the ids of the
pages it reserved; the prefill side prepares the peer's page list the first time it writes
there, and per request only names page indices in the two prepared lists (NIXL merges the
entries adjacent on both sides into one copy) and WRITEs them (a push: the data moves once,
with no round trip per page) with the request id as the notification, which NIXL delivers
after the data. Nothing here knows NATS or torch.

Where a transfer's time went before (``python -m tools.bench.kv_probe``; docs/performance.md):
NIXL's progress thread spins without pause (the Python API fixes its delay at 0), a core per
agent, so on a small host the two executors' spinning threads took the cores their copies and
steps needed; and under UCX's "peer" error handling the notification went over TCP, so every
write also waited for the receiver's next poll (see CPU_ERROR_HANDLING). Without the thread,
UCX moves only when this code asks (posting and polling a transfer, reading notifications),
which is all a push needs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from common.kv_layout import KVLayout, paired_runs

log = logging.getLogger("meshserve.executor")

MEMORY = "DRAM"  # CPU pools; a CUDA pool would register as "VRAM" with its device id
# UCX's error handling for CPU pools. NIXL's default, "peer", leaves out every transport
# without a peer-failure handler, which here is all of UCX's shared memory (sysv, posix): the
# notification then goes over TCP loopback, and a writer's transfer completes only once the
# receiver has moved UCX along (a 0.7 MB write: 2.1 ms with the receiver polling every 2 ms,
# against 0.05 ms for the copy). With "none" the notification goes through shared memory and
# the write completes on its own; a dead peer still fails it (CMA reports the process gone;
# tests/test_kv_transport.py). A GPU pool (VRAM, RDMA between hosts) would keep "peer".
CPU_ERROR_HANDLING = "none"


class TransferError(RuntimeError):
    """A transfer NIXL refused or reported failed (the peer died, a bad descriptor).
    ``posted``: it had started, so bytes may still land in the peer's pages (a cancelled
    RDMA write is not known to have stopped)."""

    def __init__(self, message: str, posted: bool = False) -> None:
        super().__init__(message)
        self.posted = posted


@dataclass(frozen=True)
class TransferResult:
    bytes: int
    seconds: float
    extents: int


def _nixl() -> Any:
    try:
        from nixl_cu12 import _api
    except ImportError as exc:  # pragma: no cover - the wheel is a dependency of the extra
        raise RuntimeError(
            "disaggregated prefill/decode needs NIXL: pip install 'meshserve[disagg]'"
        ) from exc
    return _api


@dataclass
class _Peer:
    layout: KVLayout  # its pool, as its last PrefillRequest described it
    pages: Any  # its page list prepared against that layout (a nixl_prepped_dlist_handle)


class KVTransport:
    def __init__(
        self,
        name: str,
        layout: KVLayout,
        progress_thread: bool = False,
        error_handling: str = CPU_ERROR_HANDLING,
    ) -> None:
        """``progress_thread`` (NIXL's own, spinning) and ``error_handling`` other than the
        default are for the probe, which measures what they cost."""
        api = _nixl()
        # No progress thread (see the module docstring). STRICT: the step loop's thread
        # writes while the event loop adds peers and reads notifications.
        config = api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            backends=[],  # UCX made below, with its error handling
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.name = name
        self.layout = layout
        self.agent = api.nixl_agent(name, config)
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": error_handling})
        self.registered = self.agent.register_memory(
            [(addr, size, 0, "") for addr, size in layout.regions], MEMORY
        )
        self.pages = self.agent.prep_xfer_dlist("", _descs(layout), MEMORY)
        self.metadata: bytes = self.agent.get_agent_metadata()
        self.peers: set[str] = set()
        self._prepared: dict[str, _Peer] = {}

    def add_peer(self, metadata: bytes) -> str:
        """Learn a remote agent from its metadata; returns its name."""
        raw = self.agent.add_remote_agent(metadata)  # bytes from this binding, str from others
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        self.peers.add(name)
        return name

    def forget_peer(self, name: str) -> None:
        if name in self.peers:
            self.peers.discard(name)
            peer = self._prepared.pop(name, None)
            if peer is not None:
                self.agent.release_dlist_handle(peer.pages)
            self.agent.remove_remote_agent(name)

    def _peer_pages(self, peer: str, layout: KVLayout) -> Any:
        """The peer's page list, prepared the first time we write there (and again should its
        pool ever be described differently)."""
        known = self._prepared.get(peer)
        if known is not None and known.layout == layout:
            return known.pages
        if known is not None:
            self.agent.release_dlist_handle(known.pages)
            del self._prepared[peer]
        pages = self.agent.prep_xfer_dlist(peer, _descs(layout), MEMORY)
        self._prepared[peer] = _Peer(layout, pages)
        return pages

    def write(
        self,
        peer: str,
        src_pages: list[int],
        dst_layout: KVLayout,
        dst_pages: list[int],
        notification: bytes,
        timeout_s: float,
    ) -> TransferResult:
        """Copy our ``src_pages`` into the peer's ``dst_pages`` (every layer) and wait until it
        is done; ``notification`` reaches the peer after the data. Blocks: run it where a
        step would run (the pages must not change meanwhile)."""
        runs = paired_runs(self.layout, src_pages, dst_layout, dst_pages)
        started = time.perf_counter()
        try:
            remote = self._peer_pages(peer, dst_layout)
            handle = self.agent.make_prepped_xfer(
                "WRITE",
                self.pages,
                self.layout.descriptor_indices(src_pages),
                remote,
                dst_layout.descriptor_indices(dst_pages),
                notification,
            )
        except Exception as exc:  # nixlBind raises its own types (a peer gone, a bad list)
            raise TransferError(f"NIXL refused the transfer to {peer}: {exc!r}") from exc
        try:
            state = self._wait(handle, started + timeout_s)
        except TransferError:
            raise
        except Exception as exc:  # NIXL_ERR_REMOTE_DISCONNECT and the like
            raise TransferError(f"the transfer to {peer} failed: {exc!r}", posted=True) from exc
        finally:
            self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise TransferError(f"the transfer to {peer} failed ({state})", posted=True)
        nbytes = len(src_pages) * self.layout.page_bytes * len(self.layout.layer_bases)
        extents = len(runs) * len(self.layout.layer_bases)
        return TransferResult(nbytes, time.perf_counter() - started, extents)

    def _wait(self, handle: Any, deadline: float) -> str:
        state: str = self.agent.transfer(handle)
        while state == "PROC":  # each check moves UCX along (there is no progress thread)
            if time.perf_counter() > deadline:
                raise TransferError("the transfer did not finish in time", posted=True)
            time.sleep(0)  # hand the GIL to the event loop between checks
            state = self.agent.check_xfer_state(handle)
        return state

    def notifications(self) -> list[bytes]:
        """Notifications delivered since the last call, from every peer (this call is also
        what moves UCX along on this side: there is no progress thread)."""
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]

    def close(self) -> None:
        try:
            for peer in self._prepared.values():
                self.agent.release_dlist_handle(peer.pages)
            self._prepared.clear()
            self.agent.release_dlist_handle(self.pages)
            self.agent.deregister_memory(self.registered)
        except Exception as exc:  # leaving anyway
            log.warning("executor: could not deregister the KV pool from NIXL: %s", exc)


def _descs(layout: KVLayout) -> list[tuple[int, int, int]]:
    return [(addr, size, 0) for addr, size in layout.page_extents]
