"""Paged attention on CUDA with FlashInfer (``flashinfer-python`` 0.7.x).

Per step, ``plan`` hands the batch metadata to one of two FlashInfer wrappers, once for all
layers: ``BatchDecodeWithPagedKVCacheWrapper`` when every sequence brings exactly one new token
(pure decode), otherwise ``BatchPrefillWithPagedKVCacheWrapper`` with a causal mask (prompt
chunks, with or without decodes beside them; FlashInfer aligns the causal mask bottom-right, so
query i of a sequence with L keys and Q queries sees keys ``<= L - Q + i``, as the torch backend
does). Per layer, ``attend`` writes the new keys and values into that layer's pages with
``flashinfer.append_paged_kv_cache`` and runs the planned wrapper over the paged cache
(``[num_pages, 2, page_size, num_kv_heads, head_dim]``, FlashInfer's NHD layout).

The indptr arrays are rebuilt on the host from ``meta.q_lens`` / ``meta.kv_lens`` (plain tuples),
so planning never waits on the GPU even though the runner has already moved ``meta`` there.

FlashInfer compiles its kernels on first use (JIT, a few minutes per new head size / dtype) and
caches them under ``~/.cache/flashinfer``. This module imports ``flashinfer`` only when the class
is constructed, so it imports cleanly on machines without CUDA or FlashInfer.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.attention import rope_append
from gpu.attention.metadata import BatchMetadata

INSTALL_HINT = "pip install meshserve[cuda]"
# FlashInfer's recommended float workspace (split-KV partial results); shared by both wrappers,
# which never run in the same step.
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# The pages may also hold e4m3 (``--kv-cache-dtype fp8``): FlashInfer's fa2 kernels read an fp8
# cache under fp16/bf16 queries (scale 1, as gpu/quant.py stores it), and append converts.
KV_DTYPES = (*SUPPORTED_DTYPES, torch.float8_e4m3fn)
KV_LAYOUT = "NHD"


def load_flashinfer() -> Any:
    """Import ``flashinfer`` or raise a ``RuntimeError`` that says how to install it."""
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError(
            "the FlashInfer attention backend needs the flashinfer-python package (0.7.x) and "
            f"an NVIDIA GPU; install it with: {INSTALL_HINT} (import failed: {exc})"
        ) from exc
    return flashinfer


def decode_uses_tensor_cores(num_q_heads: int, num_kv_heads: int) -> bool:
    """Whether pure-decode steps should run FlashInfer's tensor-core (prefill-kernel) path.

    The CUDA-core decode kernel handles one query row per KV head; once several query heads
    share a KV head (GQA group of 4 or more) the tensor-core kernel, which treats the group as
    a small matrix, is the faster one. tools/gpu_check/check_flashinfer.py times both.
    """
    return num_q_heads // num_kv_heads >= 4


class FlashInferPagedAttention:
    """The ``AttentionBackend`` for CUDA devices (see ``gpu/attention/backend.py``)."""

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        *,
        dtype: torch.dtype = torch.bfloat16,
        decode_tensor_cores: bool | None = None,
        prefill_backend: str = "fa2",
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        flashinfer_module: Any | None = None,
        rope_cache: torch.Tensor | None = None,
    ) -> None:
        """``dtype`` is what the first plan assumes for q and the KV cache; a step whose tensors
        differ is re-planned once. ``decode_tensor_cores=None`` picks by GQA group size.
        ``prefill_backend`` is FlashInfer's: "fa2" (default: one JIT module serves prefill and
        tensor-core decode), "fa3" (Hopper) or "auto". ``flashinfer_module`` replaces the
        ``flashinfer`` import (the CPU tests pass a stand-in, and then any device is accepted).
        ``rope_cache`` (FlashInfer's float32 cos/sin table, ``gpu.rope.cos_sin_cache``): q and
        k arrive unrotated and one Triton kernel rotates them and appends k and v
        (``gpu/attention/rope_append.py``; fp16/bf16 pages only).
        """
        if num_q_heads < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_q_heads={num_q_heads} must be a positive multiple of "
                f"num_kv_heads={num_kv_heads}"
            )
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"FlashInfer attention runs in float16 or bfloat16, not {dtype}")
        fi = load_flashinfer() if flashinfer_module is None else flashinfer_module
        device = torch.device(device)
        if flashinfer_module is None:
            if device.type != "cuda":
                raise ValueError(f"FlashInfer attention needs a CUDA device, got {device}")
            if not torch.cuda.is_available():
                raise RuntimeError("FlashInfer attention needs CUDA; torch sees no CUDA device")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._fi = fi
        self.device = device
        self.rope_cache = rope_cache
        self.rotates_qk = rope_cache is not None
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        if decode_tensor_cores is None:
            decode_tensor_cores = decode_uses_tensor_cores(num_q_heads, num_kv_heads)
        self.decode_tensor_cores = decode_tensor_cores
        self.prefill_backend = prefill_backend
        # The decode wrapper wants a zeroed workspace on first use.
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, kv_layout=KV_LAYOUT, backend=prefill_backend
        )
        self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            kv_layout=KV_LAYOUT,
            use_tensor_cores=decode_tensor_cores,
            backend="fa2",
        )
        self._q_dtype = dtype
        self._kv_dtype = dtype
        self._active: Any = None
        self._planned: Any = None  # torch.cuda.Event behind the last plan's copies
        self._decode_only = False
        self._page_size = 0
        self._num_tokens = 0
        empty = torch.empty(0, dtype=torch.int32)
        # host copies for the planners
        self._qo_indptr_host = empty
        self._kv_indptr_host = empty
        self._last_page_len_host = empty
        # device copies for append_paged_kv_cache and the kernels
        self._kv_indices = empty
        self._kv_indptr = empty
        self._last_page_len = empty
        self._batch_indices = empty
        self._positions = empty

    @property
    def decode_only(self) -> bool:
        """Whether the planned step runs the decode wrapper."""
        return self._decode_only

    def plan(self, meta: BatchMetadata) -> None:
        # FlashInfer's plan writes its schedule into a pinned buffer and queues its copy: the
        # next plan waits until the device has taken the last one (the overlapped step loop
        # plans a step while the last one runs).
        if self._planned is not None:
            self._planned.synchronize()
        ps = meta.page_size
        if sum(meta.q_lens) != meta.num_tokens or len(meta.kv_lens) != meta.num_seqs:
            raise ValueError("batch metadata is inconsistent: q_lens/kv_lens vs positions")
        qo_indptr = [0]
        kv_indptr = [0]
        last_page_len = []
        for q_len, kv_len in zip(meta.q_lens, meta.kv_lens, strict=True):
            pages = -(-kv_len // ps)
            qo_indptr.append(qo_indptr[-1] + q_len)
            kv_indptr.append(kv_indptr[-1] + pages)
            last_page_len.append(kv_len - (pages - 1) * ps)
        # Pinned on CUDA: the plan copies them to the device, and a copy from pageable memory
        # may wait for the stream (a step still running, when steps overlap).
        pin = self.device.type == "cuda"
        self._qo_indptr_host = torch.tensor(qo_indptr, dtype=torch.int32, pin_memory=pin)
        self._kv_indptr_host = torch.tensor(kv_indptr, dtype=torch.int32, pin_memory=pin)
        self._last_page_len_host = torch.tensor(last_page_len, dtype=torch.int32, pin_memory=pin)

        def on_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device, torch.int32, non_blocking=True)

        self._kv_indices = on_device(meta.kv_indices)
        self._kv_indptr = on_device(meta.kv_indptr)
        self._last_page_len = on_device(meta.kv_last_page_len)
        self._batch_indices = on_device(meta.batch_indices)
        self._positions = on_device(meta.positions)
        self._page_size = ps
        self._num_tokens = meta.num_tokens
        self._decode_only = meta.is_decode_only
        self._plan_kernels()
        if self.device.type == "cuda":
            self._planned = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._planned.record()

    def _plan_kernels(self) -> None:
        dtypes = {"q_data_type": self._q_dtype, "kv_data_type": self._kv_dtype}
        if self._decode_only:
            self._decode.plan(
                self._kv_indptr_host,
                self._kv_indices,
                self._last_page_len_host,
                self.num_q_heads,
                self.num_kv_heads,
                self.head_dim,
                self._page_size,
                pos_encoding_mode="NONE",
                **dtypes,
            )
            self._active = self._decode
        else:
            self._prefill.plan(
                self._qo_indptr_host,
                self._kv_indptr_host,
                self._kv_indices,
                self._last_page_len_host,
                self.num_q_heads,
                self.num_kv_heads,
                self.head_dim,
                self._page_size,
                causal=True,
                pos_encoding_mode="NONE",
                **dtypes,
            )
            self._active = self._prefill

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        if self._active is None:
            raise RuntimeError("FlashInferPagedAttention.attend called before plan()")
        if q.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"FlashInfer attention runs in float16 or bfloat16; q is {q.dtype} "
                "(load the model in bfloat16 on CUDA)"
            )
        if kv_cache.dtype not in KV_DTYPES:
            raise ValueError(
                f"FlashInfer attends over float16, bfloat16 or float8_e4m3fn pages, not "
                f"{kv_cache.dtype}"
            )
        if q.shape[0] != self._num_tokens:
            raise ValueError(f"q has {q.shape[0]} rows, the planned step {self._num_tokens}")
        if (q.dtype, kv_cache.dtype) != (self._q_dtype, self._kv_dtype):
            # The first step of a float16 model: plan again with the real dtypes, once.
            self._q_dtype, self._kv_dtype = q.dtype, kv_cache.dtype
            self._plan_kernels()
        if self.rope_cache is not None:
            rope_append.rope_append_(
                q, k, v, self._positions, self.rope_cache, kv_cache, self._batch_indices,
                self._kv_indptr, self._kv_indices,
            )  # fmt: skip
        else:
            if k.dtype != kv_cache.dtype:
                k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
            self._fi.append_paged_kv_cache(
                k, v, self._batch_indices, self._positions, kv_cache, self._kv_indices,
                self._kv_indptr, self._last_page_len, kv_layout=KV_LAYOUT,
            )  # fmt: skip
        if q.stride(-1) != 1:
            q = q.contiguous()
        out: torch.Tensor = self._active.run(q, kv_cache)
        return out
