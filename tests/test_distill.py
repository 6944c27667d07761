"""``meshserve distill`` on a tiny teacher: it learns, resumes, and writes a usable draft."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from gpu.engine import Engine, EngineConfig
from gpu.loader import load_model
from gpu.proposers import DraftModelProposer
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from services.launcher.cli import main as cli_main
from tests.models import write_tiny_model
from tools.distill.chat_prompts import distill_prompts
from tools.distill.recipe import (
    DistillConfig,
    build_student,
    distill,
    generate_data,
    layer_candidates,
)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return write_tiny_model(
        tmp_path_factory.mktemp("teacher") / "t", "llama", seed=3, num_hidden_layers=4
    )


def config(teacher, out, steps):
    return DistillConfig(
        teacher=teacher,
        out=out,
        layers=2,
        steps=steps,
        batch_size=4,
        lr=3e-3,
        warmup_steps=2,
        checkpoint_every=4,
        num_prompts=12,
        max_new_tokens=10,
        gen_batch=6,
        val_samples=3,
        progress=False,
    )


def test_layer_candidates_keep_the_ends():
    candidates = layer_candidates(30, 8)
    assert candidates["spread"][0] == 0 and candidates["spread"][-1] == 29
    assert all(len(ids) == 8 and len(set(ids)) == 8 for ids in candidates.values())
    assert candidates["first+last"] == [0, 1, 2, 3, 4, 5, 28, 29]


def test_a_student_of_a_mixture_of_experts_keeps_each_layers_kind(tiny_models):
    """The tiny Qwen3-MoE's layer 1 is dense (``mlp_only_layers``): a student of layers 1 and
    0 has it dense as its layer 0 and equals the teacher's layers, renumbered."""
    from tests.models import hf_model

    teacher = hf_model(tiny_models["qwen3_moe"])
    student = build_student(teacher, [1, 0])
    assert student.config.mlp_only_layers == [0]
    source = teacher.state_dict()
    for name, tensor in student.state_dict().items():
        parts = name.split(".")
        if name.startswith("model.layers."):
            parts[2] = str([1, 0][int(parts[2])])
        assert torch.equal(tensor, source[".".join(parts)]), name


def test_distill_learns_resumes_and_writes_a_draft_the_engine_verifies(teacher, tmp_path):
    out = tmp_path / "draft"
    distill(config(teacher, out, steps=4))
    meta = json.loads((out / "meshserve_distill.json").read_text())
    assert meta["steps_done"] == 4
    assert [h["step"] for h in meta["history"]] == [0, 4]
    # resume: the same command with more steps continues from the checkpoint
    distill(config(teacher, out, steps=12))
    meta = json.loads((out / "meshserve_distill.json").read_text())
    history = meta["history"]
    assert [h["step"] for h in history] == [0, 4, 8, 12]
    assert history[-1]["val_kl"] < history[0]["val_kl"]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert (out / "tokenizer.json").is_file()

    # the draft loads like any model and speculation with it keeps greedy outputs exact
    draft = DraftModelProposer(ModelRunner(load_model(out, progress=False), 64, 4))
    target = ModelRunner(load_model(teacher, progress=False), 64, 4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = [5, 9, 30, 200, 7]
    spec = Engine(target, EngineConfig(num_speculative_tokens=3), [2], draft)
    plain = Engine(ModelRunner(load_model(teacher, progress=False), 64, 4), EngineConfig(), [2])
    assert spec.generate([prompt], params) == plain.generate([prompt], params)
    assert spec.spec.num_draft_tokens > 0


def test_cli_distill(teacher, tmp_path, monkeypatch):
    """The subcommand's flags reach the recipe (a 1-step run)."""
    seen = {}

    def fake(cfg):
        seen["cfg"] = cfg
        return cfg.out

    monkeypatch.setattr("tools.distill.recipe.distill", fake)
    args = ["distill", "--teacher", str(teacher), "--out", str(tmp_path / "d")]
    flags = ["--layers", "3", "--steps", "7", "--prompts", "20", "--self-prompts", "5"]
    assert cli_main([*args, *flags]) == 0
    cfg = seen["cfg"]
    assert (cfg.layers, cfg.steps, cfg.num_prompts, cfg.teacher) == (3, 7, 20, teacher)
    assert cfg.self_prompts == 5


def test_resumed_data_must_extend_the_same_prompts(teacher, tmp_path):
    """Answers are stored by position; a resumed run whose prompt list differs before that
    position (another seed, or --prompts changed under teacher questions) is refused."""
    out = tmp_path / "d"
    samples = generate_data(dataclasses.replace(config(teacher, out, 0), num_prompts=6))
    assert len(samples) == 6
    assert torch.load(out / "work" / "data.pt", weights_only=False)["prompts"] == (
        distill_prompts(6)
    )
    more = generate_data(dataclasses.replace(config(teacher, out, 0), num_prompts=12))
    assert [s.tokens for s in more[:6]] == [s.tokens for s in samples] and len(more) == 12
    with pytest.raises(ValueError, match="answered other prompts"):
        generate_data(dataclasses.replace(config(teacher, out, 0), num_prompts=18, seed=1))


def test_distill_prompts_are_stable_distinct_and_held_out():
    """Prompts are only ever appended (a resumed run keeps its data: the first 2,304 are those
    the published draft was trained on), never repeat, and never include a benchmark prompt."""
    import hashlib

    from tools.distill.chat_prompts import distill_prompts, held_out_prompts

    prompts = distill_prompts()
    assert len(prompts) == len(set(prompts)) == 4224
    assert distill_prompts(100) == prompts[:100]
    first = hashlib.sha256("\n".join(prompts[:2304]).encode()).hexdigest()
    assert first.startswith("e3d4eb8fabd0")
    assert not set(held_out_prompts()) & set(prompts)


def test_teacher_forced_agreement(tmp_path):
    """``tools.bench.agreement``: a draft identical to the target agrees everywhere and is always
    accepted; another model agrees less, and its rates stay probabilities."""
    from tests.models import hf_model
    from tools.bench.agreement import agreement, answers

    target_dir = write_tiny_model(tmp_path / "t", "llama", seed=1)
    other_dir = write_tiny_model(tmp_path / "o", "llama", seed=2)
    prompts = [[5, 9, 30, 200, 7], [11, 12, 13]]
    outs = answers(str(target_dir), prompts, 12, [])
    assert [len(o) for o in outs] == [12, 12]
    target = hf_model(target_dir)
    same = agreement(target, hf_model(target_dir), prompts, outs)
    assert same["positions"] == 24
    assert same["greedy"] == 1.0 and same["T=1.0"] == pytest.approx(1.0, abs=1e-5)
    other = agreement(target, hf_model(other_dir), prompts, outs)
    assert other["greedy"] < 0.5 and 0.0 < other["T=1.0"] < 0.9
