"""The bytes of disaggregated prefill: KV pages written from this process's pool straight into
another executor's with NIXL (UCX underneath: shared memory or CMA between processes on one
host, RDMA between hosts, CUDA IPC or NVLink for GPU memory).

Each executor of role prefill or decode makes one agent, named after its id and process
incarnation (a restarted executor is a new agent, never confused with the old one), and
registers its whole KV pool with it once at start. A decode executor hands out its agent
metadata (once per peer: the prefill side asks for it the first time it writes there) and, per
request, the ids of the pages it reserved; the prefill side WRITEs its pages into them (a
push: the data moves once, with no round trip per page) with the request id as the
notification, which NIXL delivers after the data. Nothing here knows NATS or torch.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from common.kv_layout import KVLayout, paired_extents

log = logging.getLogger("meshserve.executor")

MEMORY = "DRAM"  # CPU pools; a CUDA pool would register as "VRAM" with its device id
# DRAM to DRAM between two processes on one host, UCX's default choice here (its shared-memory
# transports) measured 0.5-1.4 GB/s for a 50 MB write on these CPUs; CMA (one
# process_vm_writev copy by the kernel) 1.4-5.4 GB/s, against 2.4-4.8 GB/s for a memcpy of
# the same size under the same load. tcp stays for UCX's connection setup. Set only for
# CPU pools and only when the operator did not choose: on a GPU host UCX must keep cuda_ipc
# and RDMA.
CPU_UCX_TLS = "tcp,cma"


class TransferError(RuntimeError):
    """A transfer NIXL refused or reported failed (the peer died, a bad descriptor)."""


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


class KVTransport:
    def __init__(self, name: str, layout: KVLayout) -> None:
        if MEMORY == "DRAM":
            os.environ.setdefault("UCX_TLS", CPU_UCX_TLS)  # read when the agent starts UCX
        api = _nixl()
        # STRICT: the step loop's thread writes while the event loop adds peers and reads
        # notifications; NIXL's default without a listener thread assumes a single thread.
        config = api.nixl_agent_config(
            backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self.name = name
        self.layout = layout
        self.agent = api.nixl_agent(name, config)
        self.registered = self.agent.register_memory(
            [(addr, size, 0, "") for addr, size in layout.regions], MEMORY
        )
        self.metadata: bytes = self.agent.get_agent_metadata()
        self.peers: set[str] = set()

    def add_peer(self, metadata: bytes) -> str:
        """Learn a remote agent from its metadata; returns its name."""
        raw = self.agent.add_remote_agent(metadata)  # bytes from this binding, str from others
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        self.peers.add(name)
        return name

    def forget_peer(self, name: str) -> None:
        if name in self.peers:
            self.peers.discard(name)
            self.agent.remove_remote_agent(name)

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
        src, dst = paired_extents(self.layout, src_pages, dst_layout, dst_pages)
        started = time.perf_counter()
        local = self.agent.get_xfer_descs([(a, n, 0) for a, n in src], MEMORY)
        remote = self.agent.get_xfer_descs([(a, n, 0) for a, n in dst], MEMORY)
        try:
            handle = self.agent.initialize_xfer("WRITE", local, remote, peer, notification)
        except Exception as exc:  # nixlBind raises its own types (a peer gone, a bad list)
            raise TransferError(f"NIXL refused the transfer to {peer}: {exc!r}") from exc
        try:
            state = self._wait(handle, started + timeout_s)
        except TransferError:
            raise
        except Exception as exc:  # NIXL_ERR_REMOTE_DISCONNECT and the like
            raise TransferError(f"the transfer to {peer} failed: {exc!r}") from exc
        finally:
            self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise TransferError(f"the transfer to {peer} failed ({state})")
        return TransferResult(sum(n for _, n in src), time.perf_counter() - started, len(src))

    def _wait(self, handle: Any, deadline: float) -> str:
        state: str = self.agent.transfer(handle)
        while state == "PROC":
            if time.perf_counter() > deadline:
                raise TransferError("the transfer did not finish in time")
            time.sleep(0)  # UCX's progress thread moves the bytes; let it run
            state = self.agent.check_xfer_state(handle)
        return state

    def notifications(self) -> list[bytes]:
        """Notifications delivered since the last call, from every peer."""
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self.registered)
        except Exception as exc:  # leaving anyway
            log.warning("executor: could not deregister the KV pool from NIXL: %s", exc)
