"""CUDA-graph decode steps: the host side on the CPU (buckets, padding rows, the one staging
buffer, the index buffers' size), the capture and replay on CUDA (skipped elsewhere)."""

from __future__ import annotations

import importlib.util
import itertools
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu.attention.metadata import SeqChunk, build_batch_metadata
from gpu.graph_batches import (
    StagingLayout,
    bucket_for,
    fill_staging,
    graph_buckets,
    padded_batch_indices,
)

REPO = Path(__file__).resolve().parents[1]


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(3) == (1, 2, 4)
    assert graph_buckets(8) == (1, 2, 4, 8)
    assert graph_buckets(64) == (1, 2, 4, *range(8, 65, 8))
    assert graph_buckets(70)[-1] == 72
    for max_num_seqs in (1, 5, 17, 64, 256):
        buckets = graph_buckets(max_num_seqs)
        assert list(buckets) == sorted(set(buckets))
        for batch in range(1, max_num_seqs + 1):
            bucket = bucket_for(batch, buckets)
            assert bucket is not None and bucket >= batch
            # the smallest that holds it: the next smaller bucket does not
            smaller = [b for b in buckets if b < bucket]
            assert not smaller or smaller[-1] < batch
    assert bucket_for(65, graph_buckets(64)) is None  # above the largest: eager
    with pytest.raises(ValueError):
        graph_buckets(0)
    with pytest.raises(ValueError):
        bucket_for(0, (1, 2))


def test_layout_places_each_input_once_and_sizes_indices_for_the_longest_rows():
    layout = StagingLayout.for_bucket(8, max_seq_len=100, page_size=16)
    assert layout.max_pages == 8 * 7  # every row at 100 tokens: 7 pages each
    spans = [layout.input_ids, layout.positions, layout.kv_indptr, layout.kv_last_page_len,
             layout.kv_indices]  # fmt: skip
    lengths = [s.stop - s.start for s in spans]
    assert lengths == [8, 8, 9, 8, 56]
    assert all(a.stop == b.start for a, b in itertools.pairwise(spans))
    assert spans[0].start == 0 and spans[-1].stop == layout.size
    assert layout.meta_end == layout.kv_indices.start


def decode_chunks(rng: random.Random, n: int, page_size: int, num_pages: int) -> list[SeqChunk]:
    pages = list(range(num_pages))
    rng.shuffle(pages)
    chunks = []
    for _ in range(n):
        kv_len = rng.randint(1, 3 * page_size + 1)
        need = -(-kv_len // page_size)
        table, pages = tuple(pages[:need]), pages[need:]
        chunks.append(SeqChunk(table, kv_len - 1, 1))
    return chunks


def csr_attention(q, cache, kv_indptr, kv_indices, last, page_size):
    """Decode attention from FlashInfer's CSR metadata (one query row per sequence), fp32."""
    hq, d, hkv = q.shape[1], q.shape[2], cache.shape[3]
    out = torch.zeros(q.shape)
    for b in range(len(last)):
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        kv_len = (len(pages) - 1) * page_size + int(last[b])
        k = cache[pages, 0].reshape(-1, hkv, d)[:kv_len].repeat_interleave(hq // hkv, 1)
        v = cache[pages, 1].reshape(-1, hkv, d)[:kv_len].repeat_interleave(hq // hkv, 1)
        s = torch.einsum("hd,khd->hk", q[b], k) * d**-0.5
        out[b] = torch.einsum("hk,khd->hd", s.softmax(-1), v)
    return out


@pytest.mark.parametrize("n", [1, 3, 8])
def test_padded_step_attends_as_the_real_batch_and_pads_on_the_pad_page(n):
    rng = random.Random(n)
    ps, num_pages, bucket = 4, 40, 8
    pad_page = num_pages  # the pool's extra page
    chunks = decode_chunks(rng, n, ps, num_pages)
    meta = build_batch_metadata(chunks, ps)
    input_ids = torch.tensor([rng.randrange(1000) for _ in range(n)])
    layout = StagingLayout.for_bucket(bucket, max_seq_len=3 * ps + 1, page_size=ps)
    host = torch.full((layout.size + 5,), -7, dtype=torch.int32)  # stale values everywhere
    used = fill_staging(host, layout, input_ids, meta, pad_page)
    assert used == layout.kv_indices.start + meta.kv_indices.numel() + (bucket - n)

    ids, pos = host[layout.input_ids], host[layout.positions]
    indptr, last = host[layout.kv_indptr], host[layout.kv_last_page_len]
    indices = host[layout.kv_indices]
    assert ids[:n].tolist() == input_ids.tolist() and ids[n:].tolist() == [0] * (bucket - n)
    assert pos[:n].tolist() == meta.positions.tolist() and pos[n:].tolist() == [0] * (bucket - n)
    # Padding rows: one page each, the pad page, one key in it.
    pages = meta.kv_indices.numel()
    assert indptr.tolist() == [*meta.kv_indptr.tolist(), *range(pages + 1, pages + bucket - n + 1)]
    assert last[n:].tolist() == [1] * (bucket - n)
    assert indices[pages : pages + bucket - n].tolist() == [pad_page] * (bucket - n)
    assert padded_batch_indices(bucket).tolist() == list(range(bucket))

    # The real rows attend exactly as the unpadded batch does; padding reads only the pad page.
    hq, hkv, d = 4, 2, 8
    cache = torch.randn(num_pages + 1, 2, ps, hkv, d)
    q = torch.randn(bucket, hq, d)
    padded = csr_attention(q, cache, indptr, indices, last, ps)
    real = csr_attention(q[:n], cache, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, ps)
    torch.testing.assert_close(padded[:n], real)
    poisoned = cache.clone()
    poisoned[:num_pages] = float("nan")
    assert not csr_attention(q, poisoned, indptr, indices, last, ps)[n:].isnan().any()


def test_steps_a_graph_cannot_run_are_refused():
    ps = 4
    layout = StagingLayout.for_bucket(2, max_seq_len=8, page_size=ps)  # 2 pages per row
    host = torch.zeros(layout.size, dtype=torch.int32)
    prefill = build_batch_metadata([SeqChunk((0, 1), 0, 5)], ps)
    with pytest.raises(ValueError, match="only a step of decodes"):
        fill_staging(host, layout, torch.zeros(5, dtype=torch.long), prefill, 9)
    three = build_batch_metadata([SeqChunk((i,), 0, 1) for i in range(3)], ps)
    with pytest.raises(ValueError, match="do not fit the bucket of 2"):
        fill_staging(host, layout, torch.zeros(3, dtype=torch.long), three, 9)
    # The index buffer holds the bucket's longest rows: 2 rows x 2 pages, not one page more.
    full = build_batch_metadata([SeqChunk((0, 1), 7, 1), SeqChunk((2, 3), 7, 1)], ps)
    fill_staging(host, layout, torch.zeros(2, dtype=torch.long), full, 9)
    over = build_batch_metadata([SeqChunk((0, 1, 4), 8, 1), SeqChunk((2, 3), 7, 1)], ps)
    with pytest.raises(ValueError, match="5 pages do not fit the bucket's 4"):
        fill_staging(host, layout, torch.zeros(2, dtype=torch.long), over, 9)
    with pytest.raises(ValueError, match="int32"):
        fill_staging(host.long(), layout, torch.zeros(2, dtype=torch.long), full, 9)


def test_cuda_modules_import_without_flashinfer():
    code = (
        "import sys\n"
        "import gpu.graph_runner, gpu.ops, gpu.warmup, tools.gpu_check.decode_graphs\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_graph_runner_imports_without_cuda_and_refuses_a_cpu_model(tiny_llama):
    from gpu.graph_runner import DecodeGraphs
    from gpu.loader import load_model
    from gpu.runner import ModelRunner

    runner = ModelRunner(load_model(tiny_llama, progress=False), num_pages=8, page_size=4,
                         cuda_graphs=True)  # fmt: skip
    assert not runner.cuda_graphs and runner.kv.pad_pages == 0  # CPU: eager, no pad page
    assert runner.capture_graphs(8) is None and runner.graphs is None
    with pytest.raises(ValueError, match="need a CUDA model"):
        DecodeGraphs(runner.model, runner.kv, 8, 8, 32, decode_tensor_cores=False)


CUDA_READY = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_READY, reason="needs an NVIDIA GPU and flashinfer-python")
def test_graph_decode_matches_eager_decode(tiny_llama):
    from gpu.loader import load_model
    from gpu.runner import ModelRunner

    model = load_model(tiny_llama, device="cuda", dtype=torch.bfloat16, progress=False)
    eager = ModelRunner(model, num_pages=64, page_size=16)
    graphs = ModelRunner(model, num_pages=64, page_size=16, cuda_graphs=True)
    assert graphs.capture_graphs(8) is not None and graphs.graphs is not None
    prompts = [[5 + i] * (3 + 7 * i) for i in range(3)]  # 3, 10, 17 tokens: 1-2 pages
    tables = [tuple(range(4 * b, 4 * b + 4)) for b in range(3)]
    for runner in (eager, graphs):
        prefill = [SeqChunk(t, 0, len(p)) for t, p in zip(tables, prompts, strict=True)]
        runner.execute(prefill, prompts)
    for step in range(20):  # decodes, crossing the second page boundary
        chunks = [SeqChunk(t, len(p) + step, 1) for t, p in zip(tables, prompts, strict=True)]
        tokens = [[(7 * step + b) % 500 + 3] for b in range(3)]
        meta = build_batch_metadata(chunks, 16)
        assert graphs.graphs.bucket(meta, None) == 4  # 3 rows: the bucket of 4, one pad row
        want = eager.execute(chunks, tokens)
        got = graphs.execute(chunks, tokens).clone()
        assert (got - want).abs().max() <= 2e-2 * want.abs().max(), step
