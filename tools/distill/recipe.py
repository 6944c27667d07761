"""Knowledge distillation of a draft model from its target: ``meshserve distill``.

    meshserve distill --teacher PATH --out DIR [--layers 8] [--steps 300]

1. **Data.** The teacher answers a fixed set of chat prompts (``chat_prompts`` here; the
   held-out benchmark prompts are never used), then, with ``self_prompts``, questions it wrote
   itself (``teacher_questions``: free-form, not templates), through the engine, half
   greedy and half sampled at temperature 1 (top-p 0.95), and reports its top-20 logprobs at
   every answer position (``SamplingParams.logprobs``): the teacher's own distributions over
   its own text. Saved to ``DIR/work/data.pt`` after every batch of prompts, so an interrupted
   run resumes.
2. **Student.** The teacher's architecture with L layers, initialised from the teacher: the
   embeddings (and tied lm_head), the final norm and L of its layers. Which L: a few candidate
   selections (evenly spread, first layers plus the last ones) are scored by KL on validation
   data before training and the best is kept.
3. **Training.** AdamW in fp32 on KL(teacher || student) over the teacher's top-20 tokens plus
   one bucket holding the rest of the probability mass, at answer positions only. The
   embeddings stay frozen: they are the teacher's, so the draft keeps its token space, and the
   tied 49k-row lm_head is most of a small model's compute. Linear warm-up, then cosine decay.
   Every ``checkpoint_every`` steps ``DIR/work/checkpoint.pt`` and the Hugging Face folder are
   written, so a run can stop anywhere, resume, and still leave a usable draft.
4. **Output.** ``DIR/config.json`` + ``model.safetensors`` + the teacher's tokenizer files:
   a folder the speculator (or the engine) loads like any model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from common.tokenizer import Tokenizer
from gpu.engine import Engine, EngineConfig
from gpu.gguf.blocks import require_whole_folder
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from tools.distill.chat_prompts import distill_prompts
from tools.distill.teacher_questions import teacher_questions

log = logging.getLogger(__name__)

TOP_K = 20  # the engine's MAX_LOGPROBS
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


@dataclass(frozen=True)
class DistillConfig:
    teacher: Path
    out: Path
    layers: int = 8
    steps: int = 300
    batch_size: int = 8
    lr: float = 3e-4
    warmup_steps: int = 10
    checkpoint_every: int = 25
    num_prompts: int = 128
    self_prompts: int = 0  # questions the teacher writes itself (teacher_questions.py)
    max_new_tokens: int = 128
    gen_batch: int = 64
    val_samples: int = 8
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.layers < 1 or self.steps < 0 or self.batch_size < 1:
            raise ValueError("layers and batch_size must be >= 1, steps >= 0")
        if self.num_prompts <= self.val_samples or self.self_prompts < 0:
            raise ValueError("num_prompts must exceed val_samples; self_prompts must be >= 0")

    @property
    def work(self) -> Path:
        return self.out / "work"


@dataclass
class Sample:
    """One teacher answer: ``tokens`` (prompt + answer); row ``i`` of ``top_ids``/``top_lp``
    is the teacher's top-20 at position ``start + i``, which predicts answer token ``i``."""

    tokens: list[int]
    start: int
    top_ids: torch.Tensor  # int64 [R, 20]
    top_lp: torch.Tensor  # fp32 [R, 20], log-probabilities, descending

    @property
    def inputs(self) -> list[int]:
        return self.tokens[: self.start + self.top_ids.shape[0]]


def _bar(cfg: DistillConfig, **kw: Any) -> tqdm[Any]:
    return tqdm(disable=not cfg.progress, file=sys.stderr, dynamic_ncols=True, **kw)


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# -- 1. teacher data ------------------------------------------------------------------------------
def _teacher_engine(cfg: DistillConfig) -> tuple[Tokenizer, Engine]:
    tokenizer = Tokenizer.from_folder(cfg.teacher)
    runner = ModelRunner(load_model(cfg.teacher, progress=False), num_pages=2048, page_size=16)
    return tokenizer, Engine(runner, EngineConfig(2048, cfg.gen_batch), tokenizer.eos_token_ids)


def generate_data(cfg: DistillConfig) -> list[Sample]:
    """The teacher's answers and top-20 logprobs; resumes from ``work/data.pt``. The prompts:
    the first ``num_prompts`` fixed ones, then ``self_prompts`` questions the teacher wrote."""
    cfg.work.mkdir(parents=True, exist_ok=True)
    path = cfg.work / "data.pt"
    state: dict[str, Any] = {"num_prompts_done": 0, "samples": []}
    if path.is_file():
        state = torch.load(path, weights_only=False)
    done = state["num_prompts_done"]
    if done >= cfg.num_prompts + cfg.self_prompts:
        return [Sample(**s) for s in state["samples"]]
    tokenizer, engine = _teacher_engine(cfg)
    prompts = distill_prompts(cfg.num_prompts, cfg.seed)
    if cfg.self_prompts:
        questions = teacher_questions(
            cfg.work / "questions.json",
            cfg.self_prompts,
            engine,
            tokenizer,
            cfg.gen_batch,
            cfg.seed,
        )
        prompts += questions
    answered = state.get("prompts")
    if answered is not None and answered != prompts[:done]:
        raise ValueError(
            f"{path} answered other prompts: another --seed, or --prompts changed after "
            "teacher questions were answered (the questions come after the fixed prompts)"
        )
    bar = _bar(cfg, total=len(prompts), initial=done, desc="teacher answers", unit="prompt")
    while done < len(prompts):
        batch = prompts[done : done + cfg.gen_batch]
        ids = {}
        for i, text in enumerate(batch, start=done):
            prompt = tokenizer.encode_user_turn(text)
            sampled = i % 2 == 1
            params = SamplingParams(
                temperature=1.0 if sampled else 0.0,
                top_p=0.95 if sampled else 1.0,
                seed=cfg.seed * 100_003 + i if sampled else None,
                max_tokens=cfg.max_new_tokens,
                logprobs=TOP_K,
            )
            engine.add_request(str(i), prompt, params)
            ids[str(i)] = prompt
        answers: dict[str, list[tuple[int, list[tuple[int, float]]]]] = {r: [] for r in ids}
        while engine.has_unfinished():
            for out in engine.step():
                for lp in out.logprobs or []:
                    answers[out.request_id].append((lp.token_id, lp.top))
        for rid, prompt in ids.items():
            ans = answers[rid]
            state["samples"].append(
                {
                    "tokens": prompt + [t for t, _ in ans],
                    "start": len(prompt) - 1,
                    "top_ids": torch.tensor([[t for t, _ in top] for _, top in ans]),
                    "top_lp": torch.tensor([[lp for _, lp in top] for _, top in ans]),
                }
            )
        done += len(batch)
        state["num_prompts_done"] = done
        state["prompts"] = prompts[:done]
        _atomic_save(state, path)
        bar.update(len(batch))
    bar.close()
    return [Sample(**s) for s in state["samples"]]


# -- 2. the student -------------------------------------------------------------------------------
def layer_candidates(num_teacher: int, num_student: int) -> dict[str, list[int]]:
    """Selections of teacher layers to initialise the student's from."""
    n, k = num_teacher, min(num_student, num_teacher)
    spread = sorted({round(i * (n - 1) / max(1, k - 1)) for i in range(k)}) if k > 1 else [0]
    head = k - max(1, k // 4)
    candidates = {
        "spread": spread,
        "first+last": [*range(head), *range(n - (k - head), n)],
        "first+last-half": [*range(k - k // 2), *range(n - k // 2, n)],
    }
    unique: dict[str, list[int]] = {}
    for name, ids in candidates.items():
        if ids not in unique.values():
            unique[name] = ids
    return unique


def build_student(teacher: Any, layer_ids: list[int]) -> Any:
    """A copy of ``teacher`` (a transformers causal LM) keeping only ``layer_ids``."""
    # transformers takes seconds to import: only the training half of a run needs it.
    from transformers import AutoModelForCausalLM

    config = teacher.config.__class__.from_dict(teacher.config.to_dict())
    config.num_hidden_layers = len(layer_ids)
    if getattr(config, "mlp_only_layers", None) is not None:
        # a mixture of experts: each kept layer keeps its kind of MLP (sparse or dense) under
        # its new number
        step = getattr(config, "decoder_sparse_step", 1) or 1
        only = set(config.mlp_only_layers)
        config.mlp_only_layers = [
            new for new, old in enumerate(layer_ids) if old in only or (old + 1) % step
        ]
        config.decoder_sparse_step = 1
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    source = teacher.state_dict()
    state = {}
    for name in student.state_dict():
        src = name
        if name.startswith("model.layers."):
            parts = name.split(".")
            parts[2] = str(layer_ids[int(parts[2])])
            src = ".".join(parts)
        state[name] = source[src].clone()
    student.load_state_dict(state)
    return student


def batch_loss(student: Any, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean KL(teacher || student) over answer positions (top-20 + a rest bucket), and the
    fraction of positions where the student's argmax is the teacher's (greedy acceptance)."""
    width = max(len(s.inputs) for s in samples)
    ids = torch.zeros((len(samples), width), dtype=torch.int64)
    mask = torch.zeros((len(samples), width), dtype=torch.int64)
    for b, s in enumerate(samples):
        ids[b, : len(s.inputs)] = torch.tensor(s.inputs)
        mask[b, : len(s.inputs)] = 1
    hidden = student.model(input_ids=ids, attention_mask=mask).last_hidden_state
    rows = torch.cat([hidden[b, s.start : len(s.inputs)] for b, s in enumerate(samples)])
    logq = F.log_softmax(student.lm_head(rows).float(), dim=-1)
    t_ids = torch.cat([s.top_ids for s in samples])
    t_lp = torch.cat([s.top_lp for s in samples]).float()
    p = t_lp.exp()
    p_rest = (1.0 - p.sum(-1)).clamp(min=1e-8)
    q_top = logq.gather(1, t_ids)
    q_rest = torch.log1p(-q_top.exp().sum(-1).clamp(max=1.0 - 1e-6))
    kl = (p * (t_lp - q_top)).sum(-1) + p_rest * (p_rest.log() - q_rest)
    agree = (logq.argmax(-1) == t_ids[:, 0]).float().mean()
    return kl.mean(), agree


@torch.no_grad()
def evaluate(student: Any, samples: list[Sample], batch_size: int) -> tuple[float, float]:
    kls, agrees, weights = [], [], []
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        kl, agree = batch_loss(student, chunk)
        n = sum(s.top_ids.shape[0] for s in chunk)
        kls.append(float(kl) * n)
        agrees.append(float(agree) * n)
        weights.append(n)
    return sum(kls) / sum(weights), sum(agrees) / sum(weights)


def choose_layers(
    teacher: Any, num_layers: int, val: list[Sample], cfg: DistillConfig
) -> tuple[list[int], dict[str, tuple[float, float]]]:
    scores = {}
    best: tuple[float, list[int]] | None = None
    for name, ids in layer_candidates(teacher.config.num_hidden_layers, num_layers).items():
        kl, agree = evaluate(build_student(teacher, ids), val, cfg.batch_size)
        scores[name] = (kl, agree)
        log.info("layers %s %s: val KL %.3f, top-1 agreement %.3f", name, ids, kl, agree)
        if best is None or kl < best[0]:
            best = (kl, ids)
    assert best is not None
    return best[1], scores


# -- 3. training ----------------------------------------------------------------------------------
def learning_rate(cfg: DistillConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def write_folder(student: Any, cfg: DistillConfig, meta: dict[str, Any]) -> None:
    """config.json + model.safetensors + tokenizer files, replacing the previous export."""
    export = cfg.work / "export"
    shutil.rmtree(export, ignore_errors=True)
    student.save_pretrained(export, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (cfg.teacher / name).is_file():
            shutil.copy2(cfg.teacher / name, export / name)
    (export / "meshserve_distill.json").write_text(json.dumps(meta, indent=2, default=str))
    for item in export.iterdir():
        os.replace(item, cfg.out / item.name)


def distill(cfg: DistillConfig) -> Path:
    """Run (or resume) the whole recipe; returns the output folder."""
    from transformers import AutoModelForCausalLM  # heavy: see build_student

    cfg.work.mkdir(parents=True, exist_ok=True)
    samples = generate_data(cfg)
    val, train = samples[: cfg.val_samples], samples[cfg.val_samples :]
    require_whole_folder(cfg.teacher, "distillation's teacher")
    teacher = AutoModelForCausalLM.from_pretrained(cfg.teacher, dtype=torch.float32)
    ckpt_path = cfg.work / "checkpoint.pt"
    ckpt: dict[str, Any] | None = None
    if ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, weights_only=False)
        if ckpt["layers"] != cfg.layers or ckpt["teacher"] != str(cfg.teacher):
            raise ValueError(f"{ckpt_path} belongs to another run (teacher/layers differ)")
    if ckpt is not None:
        layer_ids, scores = ckpt["layer_ids"], ckpt["layer_scores"]
    else:
        layer_ids, scores = choose_layers(teacher, cfg.layers, val, cfg)
    student = build_student(teacher, layer_ids)
    del teacher
    for name, param in student.named_parameters():
        param.requires_grad_("embed_tokens" not in name and "lm_head" not in name)
    trainable = [p for p in student.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = 0
    history: list[dict[str, float]] = []
    if ckpt is not None:
        student.load_state_dict(ckpt["student"], strict=False)
        optim.load_state_dict(ckpt["optimizer"])
        step, history = ckpt["step"], ckpt["history"]
    meta: dict[str, Any] = {
        "teacher": str(cfg.teacher),
        "layer_ids": layer_ids,
        "layer_scores": scores,
        "config": asdict(cfg),
        "train_samples": len(train),
        "train_positions": sum(s.top_ids.shape[0] for s in train),
    }

    def checkpoint() -> None:
        kl, agree = evaluate(student, val, cfg.batch_size)
        history.append({"step": step, "val_kl": kl, "val_top1_agreement": agree})
        bar.write(f"step {step}: val KL {kl:.3f}, top-1 agreement {agree:.3f}")
        trainable_state = {
            k: v
            for k, v in student.state_dict().items()
            if "embed_tokens" not in k and "lm_head" not in k
        }
        _atomic_save(
            {
                "teacher": str(cfg.teacher),
                "layers": cfg.layers,
                "layer_ids": layer_ids,
                "layer_scores": scores,
                "step": step,
                "student": trainable_state,
                "optimizer": optim.state_dict(),
                "history": history,
            },
            ckpt_path,
        )
        write_folder(student, cfg, {**meta, "steps_done": step, "history": history})

    bar = _bar(cfg, total=cfg.steps, initial=step, desc="distilling", unit="step")
    if step == 0 and not history:
        checkpoint()  # the initial student's score, and a usable folder from the start
    student.train()
    while step < cfg.steps:
        rng = random.Random(cfg.seed * 1_000_003 + step)  # the batch is a function of the step
        batch = rng.sample(train, min(cfg.batch_size, len(train)))
        for group in optim.param_groups:
            group["lr"] = learning_rate(cfg, step)
        loss, agree = batch_loss(student, batch)
        optim.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optim.step()
        step += 1
        bar.update(1)
        bar.set_postfix(kl=f"{loss.item():.3f}", top1=f"{agree.item():.2f}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            student.eval()
            checkpoint()
            student.train()
    bar.close()
    return cfg.out
