"""The GPU check's ``graphs`` section (tools/gpu_check/decode_graphs.py) on the CPU: a random
model of a given shape built in place, the bytes a decode step reads, and the section's rows
(eager timed, graph rows skipped with the reason; on the GPU the same code times both)."""

from __future__ import annotations

import torch

from gpu.attention.metadata import SeqChunk
from gpu.config import ModelConfig
from gpu.runner import ModelRunner
from tests.models import TINY_BASE
from tools.gpu_check import decode_graphs as dg

SHAPE = {**TINY_BASE, "model_type": "llama", "tie_word_embeddings": False}


def test_random_model_has_the_shape_and_weight_bytes_count_every_linear():
    model = dg.random_model(SHAPE, torch.device("cpu"), torch.float32)
    cfg = ModelConfig.from_hf_dict(SHAPE)
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * i + i * h + 2 * h  # linears + 2 norms
    params = cfg.num_hidden_layers * per_layer + v * h + h  # + LM head + final norm
    assert dg.weight_bytes(model) == 4 * params
    logits = ModelRunner(model, 4, 16).execute([SeqChunk((0,), 0, 3)], [[1, 2, 3]])
    assert logits.shape == (1, v) and torch.isfinite(logits).all()
    # the 8B shape the device check builds: Llama-3-8B's parameter count
    big = ModelConfig.from_hf_dict(dg.LLAMA3_8B_CONFIG)
    assert big.head_dim == 128 and big.num_key_value_heads == 8


def test_section_times_eager_and_reports_graphs_skipped_off_cuda():
    model = dg.random_model(SHAPE, torch.device("cpu"), torch.float32)
    bandwidth = dg.measure_bandwidth(torch.device("cpu"), gib=0.01, repeats=2)
    assert bandwidth > 0
    result = dg.graphs_section(model, [1, 2], context=20, iters=2, bandwidth=bandwidth)
    eager = [r for r in result["results"] if r["mode"] == "eager"]
    graphs = [r for r in result["results"] if r["mode"] == "cuda graphs"]
    assert [r["batch"] for r in eager] == [1, 2] and all(r["ms_per_step"] > 0 for r in eager)
    runner = ModelRunner(model, 8, 16)
    for r in eager:
        assert r["bytes_per_step"] == dg.weight_bytes(model) + dg.kv_bytes(runner, r["batch"], 20)
        assert r["bandwidth_fraction"] > 0 and r["vs_weights_read"] > 0
    assert [r["skipped"] for r in graphs] == ["needs CUDA and the FlashInfer backend"] * 2
    assert result["ok"] and result["target_met"] is None
    assert "HBM fraction" in result["table"] and "measured bandwidth" in result["table"]


def test_every_graphs_mode_is_skipped_off_cuda_and_the_best_one_is_judged():
    model = dg.random_model(SHAPE, torch.device("cpu"), torch.float32)
    result = dg.graphs_section(model, [1], context=20, iters=1, bandwidth=1e9)
    graph_modes = [m.name for m in dg.MODES if m.graphs]
    assert len(graph_modes) == 8
    few_row = [m for m in dg.MODES if m.few_row_layers]
    assert few_row and all(m.triton_gemv and m.graphs for m in few_row)
    skipped = {r["mode"] for r in result["results"] if "skipped" in r}
    assert skipped == set(graph_modes)
    assert result["best_graphs_mode"] is None and result["profiles"] == {}
    # the fused mode asks the runner for the fused append, which off CUDA it ignores
    fused = dg.mode_runner(model, dg.MODES[2], 4)
    assert dg.MODES[2].fused_rope_append and not fused.backend.rotates_qk
    # the matmul table covers the linears in cuBLAS's layout: none off CUDA
    matmuls = result["matmuls"]
    assert matmuls["ok"] and {(r["n"], r["k"]) for r in matmuls["results"]} == set()  # CPU: kn


def test_modes_are_held_to_the_first_mode_s_logits():
    """Every mode's runner gets the same KV pool and one fixed step whose logits are compared
    with the first mode's; a mode that computes something else is an error row."""
    model = dg.random_model(SHAPE, torch.device("cpu"), torch.float32)
    result = dg.graphs_section(model, [1, 2], context=20, iters=1, bandwidth=1e9)
    eager = [r for r in result["results"] if r["mode"] == "eager"]
    assert [r["logits_rel_err"] for r in eager] == [0.0, 0.0]  # the reference itself
    assert all(r["mode_s"] >= 0 for r in result["results"])  # each mode's wall time
    runner = dg.mode_runner(model, dg.MODES[0], 8)
    dg.fill_kv(runner)
    first = dg.step_logits(runner, 2, 20)
    dg.step_logits(runner, 1, 20)  # other steps in between do not change it
    assert torch.equal(dg.step_logits(runner, 2, 20), first)
    other = dg.mode_runner(model, dg.MODES[0], 8)
    dg.fill_kv(other)
    references = {2: first}
    assert dg.held_to(references, 2, dg.step_logits(other, 2, 20)) == {"logits_rel_err": 0.0}
    dg.fill_kv(other, seed=1)  # another context: other logits
    row = dg.held_to(references, 2, dg.step_logits(other, 2, 20))
    assert row["logits_rel_err"] > dg.LOGITS_TOL and "differ from the first mode's" in row["error"]
    row = dg.held_to(references, 2, torch.full_like(first, float("nan")))
    assert "error" in row
    assert "logits vs first" in result["table"]


def test_kernels_are_grouped_by_kind_per_step():
    from tools.gpu_check import kernel_profile as kp

    names = {
        "void flashinfer::BatchPrefillWithPagedKVCacheKernel<KernelTraits>": "attention",
        "void flashinfer::PersistentVariableLengthMergeStatesKernel<8u>": "attention",
        "void flashinfer::AppendPagedKVCacheDecodeKernel<128u>": "kv append",
        "void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheKernel<true>": "rotary",
        "rope_append_kernel": "rotary + kv append",
        "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>": "norm",
        "void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, &silu>": "activation",
        "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "matmul",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float>": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "matmul",
        "Memcpy HtoD (Pinned -> Device)": "copy",
        "void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16>": "other",
    }
    assert {n: kp.kernel_kind(n) for n in names} == names
    kernels = [kp.KernelTime(n, 10.0) for n in names] * 2  # two steps
    kernels += [kp.KernelTime("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", 30.0)] * 2
    out = kp.breakdown(kernels, steps=2, step_ms=0.2, matmul_bytes=60_000_000)
    assert out["kinds"]["matmul"] == {"kernels_per_step": 4.0, "us_per_step": 60.0}
    assert out["kinds"]["attention"] == {"kernels_per_step": 2.0, "us_per_step": 20.0}
    assert out["kernels_per_step"] == 13.0 and out["covered_us"] == 150.0
    assert out["uncovered_us"] == 50.0  # 200 us a step, 150 of it in kernels
    assert out["matmul_gb_per_s"] == 1000.0  # 60 MB in 60 us
    assert out["top_kernels"][0]["us_per_step"] == 40.0
    table = kp.breakdown_table({"graphs": out})
    assert "not covered by a kernel" in table and "60.0 us (4.0)" in table


def test_overlap_section_compares_plain_and_overlapped_engine_steps(tiny_llama):
    from gpu.loader import load_model
    from tools.gpu_check.engine_overlap import overlap_section

    result = overlap_section(load_model(tiny_llama, progress=False), 4, 8, 6, rounds=1)
    assert result["ok"] and result["same_tokens"]
    assert result["results"]["overlapped"]["overlapping"]
    assert not result["results"]["plain"]["overlapping"]
    assert all(r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 for r in result["results"].values())
    assert "overlapped / plain" in result["table"]


def test_the_check_s_row_limit_is_the_kernel_s():
    from gpu.triton_gemv import MAX_ROWS

    assert dg.TRITON_ROWS == MAX_ROWS


def test_formats_section_runs_each_format_and_keeps_a_part_s_failure_its_own(
    tiny_llama, tmp_path, monkeypatch
):
    """The ``formats`` section on the CPU: the model part runs every format against the CPU
    reference with the bf16 baseline row (here all on the CPU paths); the matmul part needs
    CUDA, fails, and is reported as that part's error while the model part stands."""
    import argparse
    import json

    from tools.gpu_check import model_agreement as ma
    from tools.gpu_check.common import Report
    from tools.gpu_check.quant_formats import MODEL_FORMATS, run_formats_section

    # the check's text prompts run past the tiny model's context: short random ones
    monkeypatch.setattr(
        ma, "model_prompts", lambda folder, vocab, seed: (ma.random_prompts(vocab, (3, 20)), "")
    )

    args = argparse.Namespace(seed=0, new_tokens=4, logits_tol=5e-2)
    report = Report(tmp_path / "check.json")
    run_formats_section(args, tiny_llama, torch.device("cpu"), report)
    section = json.loads((tmp_path / "check.json").read_text())["sections"]["formats"]
    model = section["model"]
    assert model["build_errors"] == {}
    # on the CPU every format runs its CPU path (on CUDA a path other than the format's own
    # is a build error): the int8 layers and head, int4's Q4_1 layers and Q8_0 head
    paths = model["linear_paths"]
    assert set(paths["cuda int8 W8A16, cuda graphs"]) == {"int8"}
    assert set(paths["cuda int4 (Q4_1 blocks), cuda graphs"]) == {"Q4_1", "Q8_0"}
    for name, _, _ in MODEL_FORMATS:
        assert model[name]["ok"] == "reported" and model[name]["positions"] > 0
    assert model["cuda bf16 flashinfer"]["positions"] > 0 and model["ok"]
    assert "error" in section["matmuls"] and not section["ok"]
    assert "whole model:" in section["table"] and "matmuls: " in section["table"]
