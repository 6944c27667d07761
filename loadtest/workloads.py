"""Workloads: what each request of a load test asks for.

A workload hands out :class:`RequestSpec` objects one at a time (``next_request``) and is told
how each finished (``on_complete``), which lets a multi-turn workload build the next turn of a
conversation from the answer that was actually received.  Every workload is deterministic for
a given seed.

Prompt lengths are approximate: prompts are made of common English words that most BPE
tokenizers encode as one token each, so a prompt of ``n`` words is about ``n`` tokens (plus the
chat template's few tokens).
"""

from __future__ import annotations

import itertools
import json
import random
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "WORKLOADS",
    "LengthDist",
    "MultiTurnWorkload",
    "RequestSpec",
    "ShareGPTWorkload",
    "SharedPrefixWorkload",
    "SyntheticWorkload",
    "Workload",
    "approx_tokens",
    "random_words",
]

WORKLOADS = ("synthetic", "shared-prefix", "multi-turn", "sharegpt")

# Short, frequent words: one token each in the Llama, Qwen, GPT-2 and Mistral vocabularies
# (with the leading space).
_WORD_TEXT = (
    "the of and to in is was for on are with as his they at be this from have or by one had "
    "not but what all were when we there can an your which their said if do will each about "
    "how up out them then she many some so these would other into has more her two like him "
    "see time could no make than first been its who now people my made over did down only way "
    "find use may water long little very after words called just where most know get through "
    "back much go good new write our me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say "
    "small every found still between name should home big give air line set own under read "
    "last never us left end along while might next sound below saw something thought both few "
    "those always looked show large often together asked house world going want school important "
    "until form food keep children feet land side without boy once animals life enough took "
    "sometimes four head above kind began almost live page got earth need far hand high year "
    "mother light parts country father let night following picture being study second eyes soon "
    "times story boys since white days ever paper hard near sentence better best across during "
    "today others however sure means knew try told young miles sun ways thing whole hear example "
    "heard several change answer room sea against top turned learn point city play toward five "
    "using himself usually"
)
_WORDS = tuple(_WORD_TEXT.split())


def random_words(rng: random.Random, n: int) -> str:
    """``n`` random common words joined by spaces (about ``n`` tokens)."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(0, n)))


def approx_tokens(text: str) -> int:
    """A tokenizer-free token estimate: about four characters per token, at least one."""
    return max(1, round(len(text) / 4))


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: fixed (``low == high``) or uniform on ``[low, high]``."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 0 or self.high < self.low:
            raise ValueError(f"bad length range {self.low}..{self.high}")

    @classmethod
    def parse(cls, text: str | int) -> LengthDist:
        """``"128"`` (fixed), ``"64:256"`` or ``"64-256"`` (uniform, inclusive)."""
        if isinstance(text, int):
            return cls(text, text)
        s = text.strip()
        for sep in (":", "-", ","):
            if sep in s:
                lo, hi = s.split(sep, 1)
                return cls(int(lo), int(hi))
        return cls(int(s), int(s))

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass
class RequestSpec:
    """One request: chat messages (rendered as a prompt for the completions endpoint)."""

    messages: list[dict[str, str]]
    max_tokens: int
    input_tokens_est: int
    meta: dict[str, Any] = field(default_factory=dict)

    def prompt(self) -> str:
        """The messages as one completions-endpoint prompt."""
        if len(self.messages) == 1:
            return self.messages[0]["content"]
        parts = [f"{m['role'].capitalize()}: {m['content']}" for m in self.messages]
        parts.append("Assistant:")
        return "\n\n".join(parts)


class Workload(ABC):
    """A source of requests."""

    name: str = ""

    @abstractmethod
    def next_request(self) -> RequestSpec:
        """The next request to send (never blocks)."""

    def on_complete(self, spec: RequestSpec, answer: str | None) -> None:  # noqa: B027
        """Called when ``spec`` finished: ``answer`` is the text received, None if it failed."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """The workload's parameters, for the JSON config."""


class SyntheticWorkload(Workload):
    """Random-word prompts with input and output lengths drawn from given distributions."""

    name = "synthetic"

    def __init__(self, input_len: LengthDist, output_len: LengthDist, seed: int = 0) -> None:
        self.input_len = input_len
        self.output_len = output_len
        self._rng = random.Random(f"synthetic-{seed}")

    def next_request(self) -> RequestSpec:
        n_in = self.input_len.sample(self._rng)
        n_out = max(1, self.output_len.sample(self._rng))
        text = random_words(self._rng, n_in)
        return RequestSpec([{"role": "user", "content": text}], n_out, n_in, {"input_len": n_in})

    def describe(self) -> dict[str, Any]:
        return {"input_len": str(self.input_len), "output_len": str(self.output_len)}


class SharedPrefixWorkload(Workload):
    """``num_prefixes`` long system prompts; each request is one of them + a short question."""

    name = "shared-prefix"

    def __init__(
        self,
        num_prefixes: int,
        prefix_len: int,
        suffix_len: LengthDist,
        output_len: LengthDist,
        seed: int = 0,
    ) -> None:
        if num_prefixes < 1:
            raise ValueError("num_prefixes must be at least 1")
        self.num_prefixes = num_prefixes
        self.prefix_len = prefix_len
        self.suffix_len = suffix_len
        self.output_len = output_len
        self._rng = random.Random(f"shared-prefix-{seed}")
        self.prefixes = [
            f"System prompt {g}. " + random_words(self._rng, prefix_len)
            for g in range(num_prefixes)
        ]
        self._n = 0

    def next_request(self) -> RequestSpec:
        g = self._rng.randrange(self.num_prefixes)
        n_sfx = self.suffix_len.sample(self._rng)
        question = f"Question {self._n}: " + random_words(self._rng, n_sfx)
        self._n += 1
        messages = [
            {"role": "system", "content": self.prefixes[g]},
            {"role": "user", "content": question},
        ]
        n_out = max(1, self.output_len.sample(self._rng))
        return RequestSpec(messages, n_out, self.prefix_len + n_sfx + 5, {"prefix_id": g})

    def describe(self) -> dict[str, Any]:
        return {
            "num_prefixes": self.num_prefixes,
            "prefix_len": self.prefix_len,
            "suffix_len": str(self.suffix_len),
            "output_len": str(self.output_len),
        }


class MultiTurnWorkload(Workload):
    """Conversations of ``turns`` turns; each turn resends the history with the real answers.

    A conversation's next turn becomes available once its previous turn completed; the next
    request goes to the conversation that has waited longest, or opens a new one.  A failed
    turn ends its conversation.
    """

    name = "multi-turn"

    def __init__(
        self, turns: int, input_len: LengthDist, output_len: LengthDist, seed: int = 0
    ) -> None:
        if turns < 1:
            raise ValueError("turns must be at least 1")
        self.turns = turns
        self.input_len = input_len
        self.output_len = output_len
        self._rng = random.Random(f"multi-turn-{seed}")
        self._history: dict[int, list[dict[str, str]]] = {}
        self._ready: deque[int] = deque()
        self._next_id = 0
        self.conversations_started = 0

    def next_request(self) -> RequestSpec:
        if self._ready:
            cid = self._ready.popleft()
        else:
            cid = self._next_id
            self._next_id += 1
            self._history[cid] = []
            self.conversations_started += 1
        history = self._history[cid]
        turn = len(history) // 2
        n_in = self.input_len.sample(self._rng)
        user = {"role": "user", "content": random_words(self._rng, n_in)}
        messages = [*history, user]
        est = sum(approx_tokens(m["content"]) for m in history) + n_in
        n_out = max(1, self.output_len.sample(self._rng))
        return RequestSpec(messages, n_out, est, {"conversation_id": cid, "turn": turn})

    def on_complete(self, spec: RequestSpec, answer: str | None) -> None:
        cid = int(spec.meta["conversation_id"])
        if answer is None or int(spec.meta["turn"]) + 1 >= self.turns:
            self._history.pop(cid, None)
            return
        self._history[cid] = [*spec.messages, {"role": "assistant", "content": answer}]
        self._ready.append(cid)

    def describe(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "input_len": str(self.input_len),
            "output_len": str(self.output_len),
        }


_USER_ROLES = {"human", "user"}
_ASSISTANT_ROLES = {"gpt", "assistant", "chatgpt", "bard", "model"}


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    """The first (human, gpt) pair of a ShareGPT entry (or an OpenAI-style messages list)."""
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations", entry.get("messages"))
    if not isinstance(turns, list):
        return None
    for a, b in itertools.pairwise(turns):
        if not (isinstance(a, dict) and isinstance(b, dict)):
            continue
        ra, rb = a.get("from", a.get("role")), b.get("from", b.get("role"))
        va, vb = a.get("value", a.get("content")), b.get("value", b.get("content"))
        if ra not in _USER_ROLES or rb not in _ASSISTANT_ROLES:
            continue
        if isinstance(va, str) and isinstance(vb, str) and va.strip():
            return va, vb
    return None


class ShareGPTWorkload(Workload):
    """Prompts from a ShareGPT-format JSON file: the first human turn of each conversation.

    The output length is the reference answer's approximate token count, or ``output_len``
    when given.  Conversations are shuffled with the seed and reused cyclically.
    """

    name = "sharegpt"

    def __init__(
        self,
        path: str | Path,
        output_len: LengthDist | None = None,
        seed: int = 0,
        max_input_tokens: int | None = None,
    ) -> None:
        self.path = str(path)
        self.output_len = output_len
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of conversations")
        self.samples: list[tuple[str, int]] = []
        for entry in data:
            pair = _first_exchange(entry)
            if pair is None:
                continue
            prompt, answer = pair
            if max_input_tokens is not None and approx_tokens(prompt) > max_input_tokens:
                continue
            self.samples.append((prompt, approx_tokens(answer)))
        if not self.samples:
            raise ValueError(f"{path}: no usable human/gpt exchanges")
        self._rng = random.Random(f"sharegpt-{seed}")
        self._rng.shuffle(self.samples)
        self._n = 0

    def next_request(self) -> RequestSpec:
        prompt, ref_len = self.samples[self._n % len(self.samples)]
        idx = self._n
        self._n += 1
        n_out = self.output_len.sample(self._rng) if self.output_len is not None else ref_len
        return RequestSpec(
            [{"role": "user", "content": prompt}],
            max(1, n_out),
            approx_tokens(prompt),
            {"sample": idx % len(self.samples)},
        )

    def describe(self) -> dict[str, Any]:
        return {
            "dataset": self.path,
            "samples": len(self.samples),
            "output_len": str(self.output_len) if self.output_len is not None else "dataset",
        }
