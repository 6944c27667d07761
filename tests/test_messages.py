"""The wire schema: round trips, and a clear MessageError naming the field for bad payloads."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from typing import Any

import msgpack
import pytest

import common.wire
from common.wire.codec import Message, MessageError, decode_any
from common.wire.detokenizer import SeqTokens, StepTokens, StreamStart, WireTokenLogprob
from common.wire.executor import TokenizedRequest
from common.wire.tokenizer import MAX_CHOICES, GenerateRequest, WireSamplingParams


def request(**overrides) -> TokenizedRequest:
    fields: dict[str, Any] = dict(
        request_id="r1",
        reply_to="_INBOX.1",
        params=WireSamplingParams(max_tokens=8, temperature=0.5, stop=["\n\n"], seed=3),
        prompt_token_ids=[5, 6, 7],
        page_hashes=[2**63 - 1, 0],
        detok_shard=1,
        deadline=None,
    )
    fields.update(overrides)
    return TokenizedRequest(**fields)


def step() -> StepTokens:
    lp = WireTokenLogprob(7, -0.25, [(7, -0.25), (9, -1.5)])
    return StepTokens(
        "executor-0",
        [
            SeqTokens(
                "a", [7], None, 1, StreamStart(["x"], True, 3, 0, {"k": "v"}, "_INBOX.a", 9.5)
            ),
            SeqTokens("b", [1, 2], "stop", 5, None, [lp, lp]),
        ],
    )


@pytest.mark.parametrize(
    "message",
    [
        request(),
        request(deadline=12.5),
        request(output_token_ids=[9, 8], migrations=1),
        step(),
        WireSamplingParams(),
    ],
)
def test_round_trip(message: Message) -> None:
    assert type(message).decode(message.encode()) == message


def raw(message: Message, **changes) -> bytes:
    """``message`` on the wire with some fields of its top level map changed (None: removed)."""
    payload = msgpack.unpackb(message.encode(), raw=False)
    for key, value in changes.items():
        if value is None:
            payload.pop(key)
        else:
            payload[key] = value
    packed: bytes = msgpack.packb(payload, use_bin_type=True)
    return packed


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"detok_shard": "1"}, "TokenizedRequest.detok_shard: expected an integer, got str"),
        ({"detok_shard": True}, "TokenizedRequest.detok_shard: expected an integer, got bool"),
        ({"prompt_token_ids": [1, "2"]}, "TokenizedRequest.prompt_token_ids[1]: expected an"),
        ({"prompt_token_ids": [1, False]}, "TokenizedRequest.prompt_token_ids[1]: expected an"),
        ({"prompt_token_ids": 5}, "TokenizedRequest.prompt_token_ids: expected a list, got int"),
        ({"params": {"max_tokens": 1.5}}, "TokenizedRequest.params.max_tokens: expected an"),
        ({"params": [1]}, "TokenizedRequest.params: expected a map, got list"),
        ({"deadline": "soon"}, "TokenizedRequest.deadline: expected a number, got str"),
        ({"request_id": None}, "TokenizedRequest: missing field 'request_id'"),
        ({"t": "StepTokens"}, "expected a TokenizedRequest message, got 'StepTokens'"),
        ({"v": 99}, "TokenizedRequest: unsupported schema version 99"),
    ],
)
def test_bad_fields_are_named(changes, error) -> None:
    with pytest.raises(MessageError, match=error.replace("[", r"\[").replace("]", r"\]")):
        TokenizedRequest.decode(raw(request(), **changes))


def test_nested_lists_and_tuples_are_checked() -> None:
    seqs = msgpack.unpackb(step().encode(), raw=False)["seqs"]
    seqs[1]["logprobs"][0]["top"][1] = [9, "x"]
    with pytest.raises(MessageError, match=r"StepTokens.seqs\[1\].logprobs\[0\].top\[1\]"):
        StepTokens.decode(raw(step(), seqs=seqs))
    seqs[1]["logprobs"][0]["top"][1] = [9]
    with pytest.raises(MessageError, match="expected 2 items, got 1"):
        StepTokens.decode(raw(step(), seqs=seqs))


def test_numbers_and_optionals_convert() -> None:
    got = TokenizedRequest.decode(raw(request(), deadline=3, arrival_time=2))
    assert got.deadline == 3.0 and isinstance(got.deadline, float)
    assert isinstance(got.arrival_time, float)
    decoded = StepTokens.decode(step().encode())
    assert decoded.seqs[1].logprobs is not None
    assert decoded.seqs[1].logprobs[0].top == [(7, -0.25), (9, -1.5)]  # tuples again


def test_garbage_and_decode_any() -> None:
    with pytest.raises(MessageError, match="not msgpack"):
        TokenizedRequest.decode(b"\xc1")
    with pytest.raises(MessageError, match="not a map"):
        TokenizedRequest.decode(msgpack.packb([1, 2]))
    assert decode_any(step().encode(), TokenizedRequest, StepTokens) == step()
    with pytest.raises(MessageError, match="unexpected message type"):
        decode_any(step().encode(), TokenizedRequest)


def test_choices_get_their_own_ids_and_seeds() -> None:
    """OpenAI's n travels as one GenerateRequest; the tokenizer forwards ``choices()``."""
    seeded = GenerateRequest("cmpl-1", "_INBOX.1", WireSamplingParams(seed=7), prompt="x", n=3)
    assert seeded.choice_ids() == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
    assert [(cid, p.seed) for cid, p in seeded.choices()] == [
        ("cmpl-1-0", 7),
        ("cmpl-1-1", 8),
        ("cmpl-1-2", 9),
    ]
    assert all(p == dataclasses.replace(seeded.params, seed=p.seed) for _, p in seeded.choices())
    unseeded = dataclasses.replace(seeded, params=WireSamplingParams(temperature=0.0))
    assert [p for _, p in unseeded.choices()] == [unseeded.params] * 3
    assert GenerateRequest.decode(seeded.encode()) == seeded
    assert GenerateRequest("r", "i", WireSamplingParams()).choice_ids() == ["r-0"]


@pytest.mark.parametrize("n", [0, -1, MAX_CHOICES + 1])
def test_a_forged_n_is_refused(n: int) -> None:
    good = GenerateRequest("r", "_INBOX.1", WireSamplingParams(), prompt="x")
    with pytest.raises(MessageError, match="n must be within"):
        GenerateRequest.decode(raw(good, n=n))


def wire_classes() -> list[type[Message]]:
    """Every message class of ``common.wire``, from each module's own definitions."""
    found = []
    for info in pkgutil.iter_modules(common.wire.__path__):
        module = importlib.import_module(f"common.wire.{info.name}")
        found += [
            value
            for value in vars(module).values()
            if isinstance(value, type)
            and issubclass(value, Message)
            and value is not Message
            and value.__module__ == module.__name__
        ]
    return found


def test_every_message_class_resolves_its_fields_and_has_its_own_tag() -> None:
    """The decoder resolves field types in the defining module's globals (a nested class of
    another module must be imported there), and the type tag is the bare class name (two
    classes of one name in different modules would be one message on the wire)."""
    classes = wire_classes()
    assert len(classes) >= 28
    for kind in classes:
        assert typing.get_type_hints(kind), kind
    names = [kind.__name__ for kind in classes]
    assert len(names) == len(set(names)), sorted(names)
