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
