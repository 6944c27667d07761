"""Questions the teacher writes itself (``tools.distill.teacher_questions``): the filter keeps
the benchmark held out, and the sampling is reproducible and resumable."""

from __future__ import annotations

import json

import pytest

from common.tokenizer import Tokenizer
from gpu.engine import Engine, EngineConfig
from gpu.gguf import resolve_model_path
from gpu.loader import load_model
from gpu.runner import ModelRunner
from tools.distill.chat_prompts import held_out_prompts
from tools.distill.teacher_questions import (
    keep_question,
    near_held_out,
    teacher_questions,
    user_turn_prefix,
)


def test_keep_question_filters():
    seen: set[str] = set()
    assert keep_question("How do volcanoes form under the ocean?", True, seen)
    assert not keep_question("how do volcanoes form under the OCEAN", True, seen)  # duplicate
    assert not keep_question("How do glaciers move so slowly?", False, seen)  # cut off
    assert not keep_question("Hello there", True, seen)  # too short
    assert not keep_question(" ".join(["word"] * 61), True, seen)  # too long
    assert not keep_question("What does \ufffd mean in text?", True, seen)  # broken UTF-8
    assert not keep_question("What does \x0c mean in text?", True, seen)  # control character
    assert keep_question("How do glaciers move so slowly?", True, seen)


@pytest.mark.parametrize(
    "text",
    [
        *held_out_prompts(),
        "why is the sky blue",
        "Why is the sky so blue?",
        "Please: how do airplanes fly? Keep it short.",
        "What is the capital of France and what is it famous for",
    ],
)
def test_benchmark_prompts_and_near_copies_are_rejected(text):
    assert near_held_out(text)
    assert not keep_question(text, True, set())


def test_other_questions_are_not_near_held_out():
    assert not near_held_out("Why is the ocean salty?")
    assert not near_held_out("What are the best ways to learn a new language?")


@pytest.fixture(scope="module")
def teacher():
    """The bundled SmolLM2-135M-Instruct: a random tiny model writes no usable text."""
    folder = resolve_model_path(None)
    return folder, Tokenizer.from_folder(folder)


def engine_for(folder, tokenizer):
    runner = ModelRunner(load_model(folder, progress=False), num_pages=512, page_size=16)
    return Engine(runner, EngineConfig(2048, 16), tokenizer.eos_token_ids)


@pytest.mark.slow
def test_user_turn_prefix_ends_where_the_user_text_begins(teacher):
    _, tokenizer = teacher
    prefix = user_turn_prefix(tokenizer)
    full = tokenizer.apply_chat_template([{"role": "user", "content": "Hi?"}])
    assert full.startswith(prefix) and full[len(prefix) :].startswith("Hi?")
    assert prefix.endswith("<|im_start|>user\n")


@pytest.mark.slow
def test_questions_are_reproducible_and_resume(teacher, tmp_path):
    folder, tokenizer = teacher
    engine = engine_for(folder, tokenizer)

    def questions(name, count, seed=1):
        return teacher_questions(tmp_path / name, count, engine, tokenizer, 16, seed=seed)

    first = questions("a.json", 3)
    assert len(first) == 3 and all(keep_question(q, True, set()) for q in first)
    saved = json.loads((tmp_path / "a.json").read_text())
    assert saved["questions"][:3] == first and saved["attempts"] == 16
    # resumed with a larger count: what it has is kept and sampling goes on with new seeds
    more = questions("a.json", 16)
    assert more[:3] == first and len(set(more)) == 16
    assert json.loads((tmp_path / "a.json").read_text())["attempts"] >= 32
    # a fresh run with the same seed writes the same questions; another seed, other ones
    assert questions("b.json", 16) == more
    assert not set(questions("c.json", 3, seed=2)) & set(more)
    assert not engine.has_unfinished() and engine.pages.num_free == engine.pages.num_pages
