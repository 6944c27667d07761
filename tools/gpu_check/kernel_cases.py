"""The GPU check's ``kernels`` section: FlashInferPagedAttention (bf16) against
TorchPagedAttention (fp32, same device) on random paged batches (mixed, pure decode with each
decode kernel, pure prefill, long), and the appended KV pages bit for bit."""

from __future__ import annotations

import random
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu.attention.backend import AttentionBackend
from gpu.attention.metadata import SeqChunk, build_batch_metadata
from gpu.attention.torch_backend import TorchPagedAttention
from tools.gpu_check.common import (
    PAGE_SIZE,
    markdown_table,
    rel_l2_error,
    rel_max_error,
    synchronize,
)

KERNEL_TOL = 2e-2  # max |out - ref| / max |ref| for bf16 inputs against an fp32 reference

BackendFactory = Callable[[int, int, int, bool | None], AttentionBackend]


def flashinfer_factory(device: torch.device, **kwargs: Any) -> BackendFactory:
    """Build FlashInferPagedAttention backends (``kwargs`` go to its constructor)."""
    from gpu.attention.flashinfer_backend import FlashInferPagedAttention

    def make(hq: int, hkv: int, d: int, tensor_cores: bool | None) -> AttentionBackend:
        return FlashInferPagedAttention(
            hq, hkv, d, device, decode_tensor_cores=tensor_cores, **kwargs
        )

    return make


def wrapper_name(backend: AttentionBackend) -> str:
    """Which FlashInfer wrapper the planned step runs (for the report)."""
    if getattr(backend, "decode_only", False):
        cores = "tensor-core" if getattr(backend, "decode_tensor_cores", False) else "cuda-core"
        return f"decode ({cores})"
    return "prefill (causal)"


@dataclass(frozen=True)
class KernelCase:
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    shapes: tuple[tuple[int, int], ...]  # (num_computed, num_new) per sequence
    decode_tensor_cores: bool | None = None

    @property
    def label(self) -> str:
        tc = {None: "", True: " tc", False: " no-tc"}[self.decode_tensor_cores]
        return f"{self.name} {self.num_q_heads}/{self.num_kv_heads}x{self.head_dim}{tc}"


def batch_shapes(kind: str, rng: random.Random) -> tuple[tuple[int, int], ...]:
    """(num_computed, num_new) per sequence for one kind of step."""
    ps = PAGE_SIZE
    if kind == "mixed":  # decodes beside prompt chunks, fresh and continued
        return (
            (rng.randint(1, 700), 1),
            (0, rng.randint(20, 300)),  # a fresh prompt
            (rng.randint(1, 40) * ps, rng.randint(2, 130)),  # a later chunk, page-aligned start
            (0, 1),  # a one-token prompt: q = kv = 1
            (rng.randint(1, 500), rng.randint(2, 70)),  # a later chunk, unaligned start
            (ps - 1, 1),  # kv_len exactly one page
            (rng.randint(600, 1200), 1),
        )
    if kind == "decode":
        lengths = [0, ps - 1, 2 * ps - 1, 2 * ps] + [rng.randint(1, 1500) for _ in range(12)]
        return tuple((n, 1) for n in lengths)
    if kind == "prefill":  # prompt chunks only, one of them a single token
        return ((0, rng.randint(100, 400)), (rng.randint(1, 300), 64), (rng.randint(5, 50), 1))
    if kind == "long":  # long prompt chunk with a long decode beside it (split-KV paths)
        return ((0, 1500), (3000, 1), (rng.randint(2000, 2500), 200))
    raise ValueError(kind)


def kernel_cases(
    head_configs: Sequence[tuple[int, int]], head_dims: Sequence[int], seed: int
) -> list[KernelCase]:
    rng = random.Random(seed)
    cases = []
    for d in head_dims:
        for hq, hkv in head_configs:
            for kind in ("mixed", "prefill", "long"):
                cases.append(KernelCase(kind, hq, hkv, d, batch_shapes(kind, rng)))
            decode = batch_shapes("decode", rng)
            for tc in (True, False):
                cases.append(KernelCase("decode", hq, hkv, d, decode, tc))
    return cases


def run_kernel_case(
    case: KernelCase,
    device: torch.device,
    make_backend: BackendFactory,
    dtype: torch.dtype = torch.bfloat16,
    layers: int = 2,
    seed: int = 0,
    tol: float = KERNEL_TOL,
) -> dict[str, Any]:
    """Plan once, attend ``layers`` times (fresh caches and q/k/v each), compare with torch."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = case.num_q_heads, case.num_kv_heads, case.head_dim
    pages_per_seq = [-(-(c + n) // PAGE_SIZE) + rng.randint(0, 2) for c, n in case.shapes]
    num_pages = sum(pages_per_seq) + 3
    pool = list(range(num_pages))
    rng.shuffle(pool)  # scattered, out-of-order pages
    chunks, start = [], 0
    for (computed, new), n_pages in zip(case.shapes, pages_per_seq, strict=True):
        chunks.append(SeqChunk(tuple(pool[start : start + n_pages]), computed, new))
        start += n_pages
    meta = build_batch_metadata(chunks, PAGE_SIZE).to(device)
    tokens = meta.num_tokens
    ref_backend = TorchPagedAttention(hq, hkv, d)
    ref_backend.plan(meta)
    backend = make_backend(hq, hkv, d, case.decode_tensor_cores)
    backend.plan(meta)
    rel_max = rel_l2 = cache_diff = 0.0
    for _ in range(layers):
        # Earlier tokens' KV and the unused slots hold random values (identical in both caches).
        cache = torch.randn((num_pages, 2, PAGE_SIZE, hkv, d), generator=gen).to(dtype)
        ref_cache, test_cache = cache.float().to(device), cache.to(device)
        # q, k and v are row-strided views into one projection output, as in the model.
        qkv = torch.randn((tokens, hq + 2 * hkv, d), generator=gen).to(dtype).to(device)
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        ref = ref_backend.attend(q.float(), k.float(), v.float(), ref_cache)
        out = backend.attend(q, k, v, test_cache)
        synchronize(device)
        if tuple(out.shape) != (tokens, hq, d) or out.dtype != dtype:
            raise AssertionError(f"output is {tuple(out.shape)} {out.dtype}")
        rel_max = max(rel_max, rel_max_error(out, ref))
        rel_l2 = max(rel_l2, rel_l2_error(out, ref))
        cache_diff = max(cache_diff, (test_cache.float() - ref_cache).abs().max().item())
    ok = rel_max <= tol and cache_diff == 0.0
    return {
        "case": case.label,
        "heads": f"{hq}/{hkv}",
        "head_dim": d,
        "seqs": len(chunks),
        "tokens": tokens,
        "q_lens": [n for _, n in case.shapes],
        "kv_lens": [c + n for c, n in case.shapes],
        "wrapper": wrapper_name(backend),
        "rel_max": rel_max,
        "rel_l2": rel_l2,
        "cache_max_abs_diff": cache_diff,
        "ok": ok,
    }


def kernels_section(
    device: torch.device,
    make_backend: BackendFactory,
    cases: Sequence[KernelCase],
    seed: int,
    tol: float,
) -> dict[str, Any]:
    results = []
    for i, case in enumerate(cases):
        try:
            results.append(run_kernel_case(case, device, make_backend, seed=seed + i, tol=tol))
        except Exception as exc:  # report and go on with the other cases
            results.append({"case": case.label, "ok": False, "error": repr(exc)})
            traceback.print_exc()
    table = markdown_table(
        ["case", "seqs", "tokens", "wrapper", "rel max err", "rel l2 err", "KV pages", "ok"],
        [
            [
                r["case"],
                r.get("seqs", "-"),
                r.get("tokens", "-"),
                r.get("wrapper", r.get("error", "-")),
                r.get("rel_max", float("nan")),
                r.get("rel_l2", float("nan")),
                "exact" if r.get("cache_max_abs_diff") == 0.0 else r.get("cache_max_abs_diff"),
                r["ok"],
            ]
            for r in results
        ],
    )
    return {"tolerance": tol, "cases": results, "ok": all(r["ok"] for r in results), "table": table}
