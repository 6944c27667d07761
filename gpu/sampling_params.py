"""Per-request sampling parameters (OpenAI's ranges, validated on construction) and the
generator a seeded request owns; ``gpu.sampling`` samples with them."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu.pooler_config import POOLING_TYPES

# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS): dividing by a
# vanishing temperature only approximates argmax, badly, in fp32.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, validated on construction (OpenAI ranges).

    Invalid values raise ``ValueError`` whose message starts with the field name.
    ``stop_token_ids``, ``ignore_eos`` and ``max_tokens`` are carried for the engine; the sampler
    itself does not use them. A request from the mesh arrives as
    ``common.wire.tokenizer.WireSamplingParams`` with the same field names; ``services.sampling``
    converts it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    # vLLM's: no stop token (EOS, ``stop_token_ids``) may end it before this many output
    # tokens; the sampler gives them -inf (``SamplerInput.eos_token_ids`` names the EOS)
    min_tokens: int = 0
    # vLLM's: only these token ids may be sampled (empty: any), and these token sequences may
    # not be completed (the tokenizer encodes ``bad_words``: each word with and without a
    # leading space). The sampler gives the rest, and a bad word's last token after its
    # prefix, -inf.
    allowed_token_ids: tuple[int, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's: each prompt token's logprob, rank and top-N alternatives (gpu.prompt_logprobs)
    prompt_logprobs: int | None = None
    # An embedding request (gpu.pooling): its prompt's final hidden states pooled ("last",
    # "mean" or "cls"; "": none), cut to the first ``pooling_dimensions`` and L2-normalized
    # unless ``pooling_normalize`` is False; it comes with the one token generated.
    pooling: str = ""
    pooling_dimensions: int | None = None
    pooling_normalize: bool | None = None

    def __post_init__(self) -> None:
        def real_in(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            value = getattr(self, name)
            if not _is_real(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
            ok = (lo < value if lo_open else lo <= value) and value <= hi
            if not ok:  # also rejects NaN
                lo_b = "(" if lo_open else "["
                raise ValueError(f"{name} must be in {lo_b}{lo}, {hi}], got {value!r}")

        real_in("temperature", 0.0, 2.0)
        real_in("top_p", 0.0, 1.0, lo_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        real_in("min_p", 0.0, 1.0)
        real_in("presence_penalty", -2.0, 2.0)
        real_in("frequency_penalty", -2.0, 2.0)
        real_in("repetition_penalty", 0.0, math.inf, lo_open=True)
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(
                f"repetition_penalty must be finite and > 0, got {self.repetition_penalty!r}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}"
            )
        stop = tuple(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in stop):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", stop)  # accept a list, store a tuple
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        bias = tuple((pair[0], pair[1]) for pair in self.logit_bias)
        if not all(_is_int(t) and t >= 0 and _is_real(b) and -100.0 <= b <= 100.0 for t, b in bias):
            raise ValueError(
                f"logit_bias must be (token id >= 0, bias in [-100, 100]) pairs, got "
                f"{self.logit_bias!r}"
            )
        object.__setattr__(self, "logit_bias", bias)
        allowed = tuple(self.allowed_token_ids)
        if not all(_is_int(t) and t >= 0 for t in allowed):
            raise ValueError(
                f"allowed_token_ids must be non-negative integers, got {self.allowed_token_ids!r}"
            )
        object.__setattr__(self, "allowed_token_ids", allowed)
        words = tuple(tuple(word) for word in self.bad_words_token_ids)
        if not all(word and all(_is_int(t) and t >= 0 for t in word) for word in words):
            raise ValueError(
                "bad_words_token_ids must be non-empty sequences of non-negative integers, got "
                f"{self.bad_words_token_ids!r}"
            )
        object.__setattr__(self, "bad_words_token_ids", words)
        if self.pooling not in ("", *POOLING_TYPES):
            raise ValueError(
                f"pooling must be one of {', '.join(POOLING_TYPES)} (or empty), got "
                f"{self.pooling!r}"
            )
        dims = self.pooling_dimensions
        if dims is not None and (not _is_int(dims) or dims < 1):
            raise ValueError(f"pooling_dimensions must be None or an integer >= 1, got {dims!r}")
        if self.pooling_normalize is not None and not isinstance(self.pooling_normalize, bool):
            raise ValueError(f"pooling_normalize must be a bool, got {self.pooling_normalize!r}")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 (below ``GREEDY_EPS``): the argmax of the penalised logits."""
        return self.temperature < GREEDY_EPS

    def stop_ids_banned(self, eos_token_ids: tuple[int, ...], generated: int) -> tuple[int, ...]:
        """The stop tokens that may not be sampled after ``generated`` output tokens: every
        one (``stop_token_ids``, and the EOS unless ``ignore_eos``) while under min_tokens."""
        if generated >= self.min_tokens:
            return ()
        return self.stop_token_ids + (() if self.ignore_eos else eos_token_ids)

    def bad_word_ends(self, output_token_ids: Sequence[int]) -> tuple[int, ...]:
        """The tokens that would complete a bad word after ``output_token_ids``: each word's
        last token, where the output ends with the rest of it (a one-token word always). As
        vLLM, only the output counts, not the prompt."""
        ends = []
        for word in self.bad_words_token_ids:
            prefix = len(word) - 1
            if prefix > len(output_token_ids):
                continue
            if not prefix or tuple(output_token_ids[-prefix:]) == word[:-1]:
                ends.append(word[-1])
        return tuple(ends)

    @functools.cached_property
    def allowed_ids(self) -> torch.Tensor:
        """``allowed_token_ids`` as an int64 CPU tensor, built once: the sampler indexes with
        it every step (a list of tens of thousands of ids rebuilt per step cost ~20 ms)."""
        return torch.tensor(self.allowed_token_ids, dtype=torch.int64)

    @functools.cached_property
    def allowed_set(self) -> frozenset[int]:
        return frozenset(self.allowed_token_ids)

    @property
    def edits_logits(self) -> bool:
        """Whether the sampler changes this row's logits before penalties (step 0: a bias, a
        ban or a whitelist), which rules out its all-greedy fast path."""
        return bool(
            self.logit_bias or self.min_tokens or self.allowed_token_ids or self.bad_words_token_ids
        )

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The generator a seeded request owns (the engine keeps it across steps), else None.

    It must live on the device of the logits (a CUDA generator for CUDA logits).
    """
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


def skip_draws(generator: torch.Generator, steps: int, vocab_size: int) -> None:
    """Advance a seeded request's generator past ``steps`` sampling steps, as if it had sampled
    them here: one fp32 ``[vocab]`` uniform draw per step, as ``Sampler._noise`` takes."""
    scratch = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(steps):
        scratch.uniform_(generator=generator)
