"""services/sampling.py: the wire's sampling settings reach the engine whole, on every path."""

from __future__ import annotations

import dataclasses

import pytest

from common.wire.speculator import DraftSeq
from common.wire.tokenizer import WireSamplingParams
from gpu.sampling_params import SamplingParams
from services import sampling
from services.sampling import sampling_params
from services.speculator.wire import draft_request

# Every field away from its default, so a field the conversion forgot shows up as a default.
WIRE = WireSamplingParams(
    max_tokens=33,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=1234,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.1,
    stop=["\n\n"],
    stop_token_ids=[2, 7],
    ignore_eos=True,
    logprobs=3,
    skip_special_tokens=False,
    logit_bias=[(5, -100.0), (9, 2.5)],
    min_tokens=4,
    include_stop_str_in_output=True,
    allowed_token_ids=[1, 2, 3],
    bad_words_token_ids=[[4, 5], [6]],
    prompt_logprobs=2,
    echo=True,
    pooling="mean",
    pooling_dimensions=8,
    pooling_normalize=False,
)


def test_every_wire_field_is_carried_or_the_detokenizers() -> None:
    """Adding a field to one type and not the other fails here (and at import)."""
    wire = {f.name for f in dataclasses.fields(WireSamplingParams)}
    engine = {f.name for f in dataclasses.fields(SamplingParams)}
    text_only = {"stop", "skip_special_tokens", "include_stop_str_in_output", "echo"}
    assert wire - engine == WireSamplingParams.DETOKENIZER_ONLY == text_only
    assert engine <= wire, f"engine fields the wire cannot carry: {engine - wire}"
    assert sampling.unmatched_fields() == (set(), set())


def test_the_example_sets_every_field() -> None:
    default = WireSamplingParams()
    same = [
        f.name
        for f in dataclasses.fields(WireSamplingParams)
        if getattr(WIRE, f.name) == getattr(default, f.name)
    ]
    assert not same, f"give these a non-default value in WIRE: {same}"


def test_conversion_copies_every_engine_field() -> None:
    params = sampling_params(WIRE)
    for f in dataclasses.fields(SamplingParams):
        wire = getattr(WIRE, f.name)
        assert getattr(params, f.name) == (tuples(wire) if isinstance(wire, list) else wire), f.name
    assert params.stop_token_ids == (2, 7) and params.logprobs == 3
    assert params.bad_words_token_ids == ((4, 5), (6,))


def tuples(value: object) -> object:
    return tuple(tuples(v) for v in value) if isinstance(value, list | tuple) else value


def test_the_speculator_gets_the_same_params_as_the_executor() -> None:
    """Its path once dropped ``stop_token_ids`` and ``logprobs``."""
    request = draft_request(DraftSeq("r", [1, 2, 3], 2, 4, WIRE))
    assert request.params == sampling_params(WIRE)


def test_out_of_range_names_the_field() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        sampling_params(dataclasses.replace(WIRE, logprobs=21))


def test_a_field_on_one_side_only_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WireSamplingParams, "DETOKENIZER_ONLY", frozenset({"stop"}))
    with pytest.raises(TypeError, match="skip_special_tokens"):
        sampling._check_fields()
