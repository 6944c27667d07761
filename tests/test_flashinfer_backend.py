"""The FlashInfer attention backend.

On any machine: the module imports without CUDA or flashinfer and refuses clearly, and its
planning and KV-append plumbing (host indptr arrays, int32 device arrays, one plan per step,
decode vs prefill wrapper, dtype re-plan) is checked against the torch backend through a plain
stand-in of the slice of flashinfer 0.7's API it calls (same parameter names, reference math).
The GPU check script's pieces run here on that stand-in too.

Marked ``cuda``: the real kernels against the torch backend, skipped without CUDA + flashinfer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from gpu.attention import flashinfer_backend as fb
from gpu.attention.metadata import SeqChunk, build_batch_metadata
from gpu.attention.torch_backend import TorchPagedAttention
from gpu.loader import load_model
from gpu.runner import ModelRunner, make_backend
from tools.gpu_check import check_model, common
from tools.gpu_check import decode_timing as dt
from tools.gpu_check import kernel_cases as kc
from tools.gpu_check import model_agreement as ma

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- stand-in


def _attention(q, cache, qo, kv_indptr, kv_indices, last, ps, causal):
    """Reference paged attention from FlashInfer's CSR metadata, in fp32 (bottom-right causal)."""
    hq, d, hkv = q.shape[1], q.shape[2], cache.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(len(last)):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        kv_len = (len(pages) - 1) * ps + int(last[b])
        k = cache[pages, 0].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(hq // hkv, 1)
        v = cache[pages, 1].reshape(-1, hkv, d)[:kv_len].float().repeat_interleave(hq // hkv, 1)
        qb = q[rows].float()
        s = torch.einsum("qhd,khd->hqk", qb, k) * d**-0.5
        if causal:
            n_q = qb.shape[0]
            allowed = torch.arange(kv_len)[None, :] <= (kv_len - n_q + torch.arange(n_q))[:, None]
            s = s.masked_fill(~allowed, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out.to(q.dtype)


class _Wrapper:
    def __init__(self, fake):
        self.fake = fake
        self.planned: tuple[Any, ...] | None = None

    def _store(self, qo, kv_indptr, kv_indices, last, hq, hkv, d, ps, causal, q_dt, kv_dt):
        for t in (qo, kv_indptr, last):  # host arrays: planning must not wait on the GPU
            assert t.dtype == torch.int32 and t.device.type == "cpu"
        assert kv_indices.dtype == torch.int32
        assert int(kv_indptr[-1]) == kv_indices.numel()
        self.fake.plans.append(type(self).__name__)
        self.planned = (qo, kv_indptr, kv_indices.cpu(), last, hq, hkv, d, ps, causal, q_dt, kv_dt)

    def run(self, q, paged_kv_cache, *args, **kwargs):
        assert not args and not kwargs
        assert self.planned is not None, "run() before plan()"
        qo, kv_indptr, kv_indices, last, hq, hkv, d, ps, causal, q_dt, kv_dt = self.planned
        if q.dtype != q_dt or paged_kv_cache.dtype != kv_dt:  # as flashinfer's run() checks
            raise ValueError("dtype does not match the plan")
        assert tuple(q.shape[1:]) == (hq, d) and q.shape[0] == int(qo[-1])
        assert paged_kv_cache.shape[1:] == (2, ps, hkv, d)
        self.fake.runs.append(type(self).__name__)
        return _attention(q, paged_kv_cache, qo, kv_indptr, kv_indices, last, ps, causal)


class FakePrefill(_Wrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, *, fake=None,
                 backend="auto"):  # fmt: skip
        assert kv_layout == "NHD" and not use_cuda_graph
        super().__init__(fake)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True):  # fmt: skip
        assert pos_encoding_mode == "NONE" and causal
        self._store(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                    num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, q_data_type,
                    kv_data_type or q_data_type)  # fmt: skip


class FakeDecode(_Wrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, *, fake=None, backend="auto"):  # fmt: skip
        assert kv_layout == "NHD" and not use_cuda_graph
        super().__init__(fake)
        self.use_tensor_cores = use_tensor_cores

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None,
             sm_scale=None, rope_scale=None, rope_theta=None, non_blocking=True):  # fmt: skip
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._store(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                    page_size, False, q_data_type, kv_data_type or q_data_type)  # fmt: skip


def make_fake_flashinfer() -> types.SimpleNamespace:
    fake = types.SimpleNamespace(plans=[], runs=[], appends=0)

    def append_paged_kv_cache(append_key, append_value, batch_indices, positions,
                              paged_kv_cache, kv_indices, kv_indptr, kv_last_page_len,
                              kv_layout="NHD"):  # fmt: skip
        for t in (batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len):
            assert t.dtype == torch.int32 and t.is_contiguous()
        assert append_key.stride(-1) == 1 and append_value.stride(-1) == 1
        assert append_key.dtype == paged_kv_cache.dtype and kv_layout == "NHD"
        ps = paged_kv_cache.shape[2]
        b, pos = batch_indices.long(), positions.long()
        n_pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
        kv_len = (n_pages - 1) * ps + kv_last_page_len.long()
        assert bool((pos < kv_len[b]).all()), "appending past the planned KV length"
        page = kv_indices.long()[kv_indptr.long()[b] + pos // ps]
        paged_kv_cache[page, 0, pos % ps] = append_key
        paged_kv_cache[page, 1, pos % ps] = append_value
        fake.appends += 1

    fake.append_paged_kv_cache = append_paged_kv_cache
    fake.BatchPrefillWithPagedKVCacheWrapper = lambda *a, **k: FakePrefill(*a, fake=fake, **k)
    fake.BatchDecodeWithPagedKVCacheWrapper = lambda *a, **k: FakeDecode(*a, fake=fake, **k)
    return fake


def fake_backend(fake, hq, hkv, d, tensor_cores=None, dtype=torch.bfloat16):
    return fb.FlashInferPagedAttention(
        hq, hkv, d, "cpu", dtype=dtype, decode_tensor_cores=tensor_cores,
        workspace_bytes=64, flashinfer_module=fake,
    )  # fmt: skip


def fake_factory(fake):
    return lambda hq, hkv, d, tc: fake_backend(fake, hq, hkv, d, tc)


# --------------------------------------------------------------------------- CPU tests


def test_module_imports_without_cuda_and_does_not_import_flashinfer():
    code = (
        "import sys\n"
        "import gpu.attention.flashinfer_backend, tools.gpu_check.check_flashinfer, gpu.runner\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_missing_flashinfer_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    with pytest.raises(RuntimeError, match=r"pip install meshserve\[cuda\]"):
        fb.FlashInferPagedAttention(9, 3, 64, "cuda")
    from gpu.config import ModelConfig
    from tests.models import TINY_BASE

    config = ModelConfig.from_hf_dict({**TINY_BASE, "model_type": "llama"})
    with pytest.raises(RuntimeError, match=r"pip install meshserve\[cuda\]"):
        make_backend(config, torch.device("cuda"))


def test_constructor_checks():
    fake = make_fake_flashinfer()
    with pytest.raises(ValueError, match="multiple"):
        fake_backend(fake, 9, 2, 64)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        fake_backend(fake, 9, 3, 64, dtype=torch.float32)
    assert fb.decode_uses_tensor_cores(32, 8) and not fb.decode_uses_tensor_cores(9, 3)
    assert fake_backend(fake, 32, 8, 64).decode_tensor_cores
    assert not fake_backend(fake, 9, 3, 64).decode_tensor_cores


@pytest.mark.parametrize(
    "case",
    kc.kernel_cases([(9, 3), (8, 2)], [16], seed=0),
    ids=lambda c: c.label.replace(" ", "-"),
)
def test_plumbing_matches_torch_backend(case):
    """The check script's kernel comparison, with the stand-in in FlashInfer's place."""
    fake = make_fake_flashinfer()
    result = kc.run_kernel_case(case, torch.device("cpu"), fake_factory(fake), layers=2)
    assert result["ok"], result
    assert result["cache_max_abs_diff"] == 0.0
    decode = all(n == 1 for _, n in case.shapes)
    expected = "FakeDecode" if decode else "FakePrefill"
    assert fake.plans == [expected] and fake.runs == [expected] * 2 and fake.appends == 2
    assert result["wrapper"].startswith("decode" if decode else "prefill")


def test_plan_once_per_step_and_replan_for_float16():
    fake = make_fake_flashinfer()
    backend = fake_backend(fake, 4, 2, 16)  # plans for bf16 by default
    chunks = [SeqChunk(tuple(range(4)), 5, 1), SeqChunk(tuple(range(4, 8)), 0, 20)]
    meta = build_batch_metadata(chunks, 16)
    ref = TorchPagedAttention(4, 2, 16)
    ref.plan(meta)
    backend.plan(meta)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn((8, 2, 16, 2, 16), generator=gen).half()
    ref_cache = cache.float()
    for _layer in range(3):
        q = torch.randn((21, 4, 16), generator=gen).half()
        k, v = torch.randn((2, 21, 2, 16), generator=gen).half()
        out = backend.attend(q, k, v, cache)
        expected = ref.attend(q.float(), k.float(), v.float(), ref_cache)
        assert out.dtype == torch.float16
        assert common.rel_max_error(out, expected) < 5e-3
    # bf16 plan at plan(), one fp16 re-plan at the first attend, none after
    assert fake.plans == ["FakePrefill", "FakePrefill"]
    backend.plan(meta)
    assert fake.plans[-1] == "FakePrefill" and len(fake.plans) == 3
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        backend.attend(q.float(), k.float(), v.float(), cache.float())
    with pytest.raises(ValueError, match="rows"):
        backend.attend(q[:3], k[:3], v[:3], cache)


def test_fp8_pages_are_attended_by_flashinfer_with_bf16_queries():
    """--kv-cache-dtype fp8 on CUDA: e4m3 pages under bf16 queries go to FlashInfer (planned
    with kv_data_type e4m3, keys and values converted on append), as the torch backend reads
    the same pages."""
    fake = make_fake_flashinfer()
    backend = fake_backend(fake, 4, 2, 16)
    fp8 = torch.float8_e4m3fn
    chunks = [SeqChunk((3, 1), 17, 1), SeqChunk((0, 2), 0, 9)]
    meta = build_batch_metadata(chunks, 16)
    ref = TorchPagedAttention(4, 2, 16)
    ref.plan(meta)
    backend.plan(meta)
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn((4, 2, 16, 2, 16), generator=gen).to(fp8)
    ref_cache = cache.clone()
    q = torch.randn((10, 4, 16), generator=gen).bfloat16()
    k, v = torch.randn((2, 10, 2, 16), generator=gen).bfloat16()
    out = backend.attend(q, k, v, cache)
    expected = ref.attend(q, k, v, ref_cache)
    assert out.dtype == torch.bfloat16
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))  # same e4m3 bits
    assert common.rel_max_error(out, expected) < 2e-2
    assert fake.plans == ["FakePrefill", "FakePrefill"]  # re-planned once for the e4m3 pages
    with pytest.raises(ValueError, match="float8_e4m3fn pages"):
        backend.attend(q, k, v, cache.view(torch.int8))


def test_attend_before_plan_is_an_error():
    backend = fake_backend(make_fake_flashinfer(), 4, 2, 16)
    x = torch.zeros((1, 4, 16), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="before plan"):
        backend.attend(x, x[:, :2], x[:, :2], torch.zeros((1, 2, 16, 2, 16), dtype=torch.bfloat16))


def stand_in_section(folder):
    """The model section's parts for ``folder``: the stand-in, the prompts, the pages they
    need, the fp32 reference runner, and the bf16 model on the stand-in and on torch."""
    fake = make_fake_flashinfer()
    prompts = ma.random_prompts(512, (1, 7, 40, 90), seed=1)
    pages = ma.pages_needed(prompts, 5)
    ref_runner = ModelRunner(load_model(folder), pages, 16)
    bf16 = load_model(folder, dtype=torch.bfloat16)
    cfg = bf16.config
    backend = fake_backend(fake, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    runner = ModelRunner(bf16, pages, 16, backend=backend)
    return fake, prompts, pages, ref_runner, runner, ModelRunner(bf16, pages, 16)


def test_model_section_with_stand_in(tiny_llama):
    """The check's whole-model comparison: bf16 model + stand-in vs fp32 model + torch."""
    fake, prompts, pages, ref_runner, runner, baseline = stand_in_section(tiny_llama)
    # a quantized runner is reported: its error neither sets the bound nor fails the section
    int8 = ModelRunner(load_model(tiny_llama, quantization="int8"), pages, 16)
    # and one whose kernels fail is a row of its own, not the section's end
    broken = ModelRunner(load_model(tiny_llama, quantization="int8"), pages, 16)

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no kernel image")

    broken.execute = fail  # type: ignore[method-assign,assignment]
    runners = {"stand-in": runner, "torch": baseline, "int8": int8, "broken": broken}
    result = ma.model_section(
        ref_runner, runners, "stand-in", prompts, 5, 5e-2, chunk=16, reported=["int8", "broken"]
    )
    assert result["ok"], result["table"]
    assert result["int8"]["ok"] == "reported" and result["int8"]["rel_max"] > 0
    assert result["broken"] == {"error": "RuntimeError: no kernel image", "ok": "failed"}
    assert "no kernel image" in result["table"]
    assert result["bound"] == max(5e-2, 1.5 * result["torch"]["rel_max"])
    assert result["stand-in"]["steps"]["mixed"] > 0
    assert result["stand-in"]["steps"]["decode_only"] > 0
    assert "FakeDecode" in fake.runs and "FakePrefill" in fake.runs


def test_model_section_with_stand_in_on_a_mixture_of_experts(tiny_models):
    """The check's qwen3_moe section on the tiny Qwen3-MoE: in bf16 its routing may pick
    other experts than fp32's on near ties, and the section still holds it to the bf16
    baseline's bound."""
    _, prompts, _, ref_runner, runner, baseline = stand_in_section(tiny_models["qwen3_moe"])
    runners = {"stand-in": runner, "torch": baseline}
    result = ma.model_section(ref_runner, runners, "stand-in", prompts, 5, 5e-2, chunk=16)
    assert result["ok"], result["table"]
    assert result["stand-in"]["steps"]["decode_only"] > 0


def test_schedule_teacher_forcing_reproduces_greedy(tiny_llama):
    runner = ModelRunner(load_model(tiny_llama), 64, 16)
    prompts = ma.random_prompts(512, (3, 30), seed=2)
    free = ma.run_schedule(runner, prompts, 6, chunk=8)
    forced = ma.run_schedule(runner, prompts, 6, chunk=8, forced=free.tokens)
    assert forced.tokens == free.tokens
    for a, b in zip(free.logits, forced.logits, strict=True):
        assert a.shape == (6, 512)
        torch.testing.assert_close(a, b)
    metrics = ma.compare_traces(free, forced, free)
    assert metrics["top1_agreement"] == 1.0 and metrics["rel_max"] == 0.0


def test_timing_section_on_cpu(tiny_llama):
    runner = ModelRunner(load_model(tiny_llama), 2 * 3 + 1, 16)
    backends = {"torch": runner.backend}
    result = dt.timing_section(runner, backends, [1, 2], context=40, iters=1)
    assert result["ok"], result
    assert [r["batch"] for r in result["results"]] == [1, 2]
    assert all(r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 for r in result["results"])
    assert "| torch | 2 | 40 |" in result["table"]


def test_synthetic_model_has_the_requested_shape(tmp_path):
    config = {**check_model.SMOLLM2_CONFIG, "vocab_size": 300, "num_hidden_layers": 2}
    folder = check_model.write_synthetic_model(tmp_path / "m", config)
    model = load_model(folder)
    assert model.config.head_dim == 64 and model.config.num_key_value_heads == 3
    prompts, kind = ma.model_prompts(folder, 300)
    assert kind == "random token ids"
    assert [len(p) for p in prompts] == list(ma.SYNTHETIC_PROMPT_LENGTHS)


def test_report_writes_json_after_each_section(tmp_path):
    report = common.Report(tmp_path / "r.json")
    report.section("kernels", {"ok": True, "table": "| a |"})
    assert '"kernels"' in (tmp_path / "r.json").read_text()
    report.error("model", RuntimeError("boom"))
    written = json.loads((tmp_path / "r.json").read_text())
    assert set(written["elapsed_s"]) == {"kernels", "model"}  # when each section ended
    assert 0 <= written["elapsed_s"]["kernels"] <= written["elapsed_s"]["model"]
    assert written["errors"] == ["model: RuntimeError('boom')"]


# --------------------------------------------------------------------------- CUDA


@pytest.fixture(scope="module")
def cuda_device():
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (torch sees no CUDA device)")
    try:
        import flashinfer  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"flashinfer is not installed ({exc}): pip install meshserve[cuda]")
    return torch.device("cuda", 0)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "case",
    kc.kernel_cases([(9, 3), (32, 8)], [64], seed=0),
    ids=lambda c: c.label.replace(" ", "-"),
)
def test_flashinfer_matches_torch_backend(cuda_device, case):
    result = kc.run_kernel_case(case, cuda_device, kc.flashinfer_factory(cuda_device))
    assert result["ok"], result


@pytest.mark.cuda
def test_flashinfer_model_matches_cpu_reference(cuda_device, tmp_path):
    from tests.models import write_tiny_model

    # FlashInfer compiles head sizes 64/128/256: a tiny model with head_dim 64.
    folder = write_tiny_model(tmp_path / "m", "llama", hidden_size=256, num_attention_heads=4)
    prompts = ma.random_prompts(512, (1, 9, 40, 150), seed=0)
    pages = ma.pages_needed(prompts, 8)
    ref_runner = ModelRunner(load_model(folder), pages, 16)
    gpu = load_model(folder, device=cuda_device)
    runner = ModelRunner(gpu, pages, 16)
    assert isinstance(runner.backend, fb.FlashInferPagedAttention)
    result = ma.model_section(ref_runner, {"flashinfer": runner}, "flashinfer", prompts, 8, 5e-2)
    assert result["ok"], result["table"]


def test_the_moe_timing_takes_turns_and_leaves_the_experts_grouped(tiny_models):
    """The check's qwen3_moe timing on the CPU (Triton's interpreter): both modes at each
    batch size, and the experts grouped again after."""
    from tools.gpu_check import moe_timing as mt

    model = load_model(tiny_models["qwen3_moe"], dtype=torch.bfloat16, cpu_kernels=False)
    moe = cast(Any, model.layers[0]).moe
    assert moe is not None and moe.stack_experts()
    stacked = moe.stacked_gate_up
    result = mt.moe_timing(model, [1, 2], context=20, iters=1)
    assert result["ok"], result
    assert [(r["mode"], r["batch"]) for r in result["results"]] == [
        (mode, batch) for batch in (1, 2) for mode in mt.MODES
    ]
    assert all(r["ms_per_step"] > 0 for r in result["results"])
    assert moe.stacked_gate_up is stacked
    unstacked = load_model(tiny_models["qwen3_moe"], dtype=torch.bfloat16, cpu_kernels=False)
    assert not mt.moe_timing(unstacked, [1], context=20, iters=1)["ok"]
