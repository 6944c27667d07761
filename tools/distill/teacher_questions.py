"""Questions the teacher writes itself, for distillation prompts that are not templates.

An instruction-tuned model given its chat template up to the start of a user turn, and nothing
else, writes a user message: the kind of request it was tuned on (the "Magpie" recipe, Xu et
al. 2024). Sampled at temperature 1, these are the teacher's own distribution of questions;
a draft distilled on its answers to them sees free-form requests instead of the eight-to-forty
phrasings of ``tools.distill.chat_prompts``.

Kept: a turn the teacher ended itself (a stop token, not the length limit), of 3 to 60 words,
printable (no broken UTF-8 or control characters), not seen before (case and punctuation
folded), and not close to any held-out benchmark prompt (word-set Jaccard similarity below 0.5,
and not containing one), so the benchmark stays held out. Saved to ``questions.json`` with the
number of sampling attempts, so a resumed run draws the same sequence of seeds and gets the
same questions.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tools.distill.chat_prompts import held_out_prompts

SENTINEL = "\x00meshserve-user-turn\x00"
MIN_WORDS, MAX_WORDS = 3, 60
MAX_QUESTION_TOKENS = 64
HELD_OUT_JACCARD = 0.5
MAX_BATCHES_PER_KEPT_BATCH = 20  # give up when almost nothing the teacher writes is usable


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _key(text: str) -> str:
    return " ".join(_words(text))


# (word set, " folded text ") of each benchmark prompt, computed once
_HELD_OUT = [(set(_words(p)), f" {_key(p)} ") for p in held_out_prompts()]


def near_held_out(text: str) -> bool:
    """Is ``text`` one of the benchmark prompts, or close to one?"""
    words, key = set(_words(text)), f" {_key(text)} "
    for other, other_key in _HELD_OUT:
        jaccard = len(words & other) / max(1, len(words | other))
        if other_key in key or jaccard >= HELD_OUT_JACCARD:
            return True
    return False


def keep_question(text: str, ended_turn: bool, seen: set[str]) -> bool:
    """The filter described in the module docstring; adds a kept question's key to ``seen``."""
    words = _words(text)
    if not ended_turn or not MIN_WORDS <= len(words) <= MAX_WORDS:
        return False
    if "\ufffd" in text or any(not c.isprintable() and c not in "\n\t" for c in text):
        return False  # broken UTF-8 or control characters: not a question anyone types
    key = _key(text)
    if key in seen or near_held_out(text):
        return False
    seen.add(key)
    return True


def user_turn_prefix(tokenizer: Any) -> str:
    """The chat template rendered up to where a user message's text would begin."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}])
    return str(chat[: chat.index(SENTINEL)])


def teacher_questions(
    path: Path, count: int, engine: Any, tokenizer: Any, batch: int, seed: int
) -> list[str]:
    """``count`` questions written by the teacher behind ``engine``; resumes from ``path``."""
    # gpu.sampling_params imports torch; the prompt and filter half of this module is plain text.
    from gpu.sampling_params import SamplingParams
    from gpu.sequence import FinishReason

    state: dict[str, Any] = {"attempts": 0, "questions": []}
    if path.is_file():
        state = json.loads(path.read_text())
    questions: list[str] = state["questions"]
    seen = {_key(q) for q in questions}
    prompt = tokenizer.encode(user_turn_prefix(tokenizer), add_special_tokens=False)
    batches = 0
    while len(questions) < count:
        if batches > MAX_BATCHES_PER_KEPT_BATCH * max(1, count // batch):
            raise RuntimeError(
                f"the teacher wrote only {len(questions)} usable questions in "
                f"{state['attempts']} tries; is it an instruction-tuned chat model?"
            )
        texts: dict[str, list[int]] = {}
        for i in range(state["attempts"], state["attempts"] + batch):
            params = SamplingParams(
                temperature=1.0,
                top_p=0.95,
                seed=seed * 1_000_033 + i,
                max_tokens=MAX_QUESTION_TOKENS,
            )
            engine.add_request(f"q{i}", prompt, params)
            texts[f"q{i}"] = []
        ended: set[str] = set()
        while engine.has_unfinished():
            for out in engine.step():
                texts[out.request_id].extend(out.new_token_ids)
                if out.finish_reason is FinishReason.STOP:
                    ended.add(out.request_id)
        # All usable ones are kept, in seed order, so the list does not depend on ``count``
        # (a resumed run with a larger count gets what a single run would have).
        for rid, ids in texts.items():
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            if keep_question(text, rid in ended, seen):
                questions.append(text)
        state["attempts"] += batch
        batches += 1
        path.write_text(json.dumps(state, indent=0, ensure_ascii=False))
    return questions[:count]
