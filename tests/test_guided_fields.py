"""vLLM's structured-output fields at the gateway and the tokenizer: guided_json, guided_regex,
guided_choice, guided_grammar, structured_outputs, and response_format on /v1/completions."""

from __future__ import annotations

import json

import pytest

from common.runtime import RequestError
from common.wire.tokenizer import ResponseFormat
from services.gateway import GatewayConfig
from services.gateway.protocol import parse_chat, parse_completion
from services.tokenizer.grammars import grammar_for

CONFIG = GatewayConfig(served_model_name="m")
CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"guided_json": {"type": "object"}},
         ResponseFormat("json_schema", '{"type": "object"}', "guided_json", "guided_json")),
        ({"guided_json": '{"type": "object"}'},
         ResponseFormat("json_schema", '{"type": "object"}', "guided_json", "guided_json")),
        ({"guided_regex": "[0-9]+"},
         ResponseFormat("regex", "[0-9]+", "guided_regex", "guided_regex")),
        ({"guided_choice": ["a", "b"]},
         ResponseFormat("choice", '["a", "b"]', "guided_choice", "guided_choice")),
        ({"guided_grammar": 'root ::= "x"'},
         ResponseFormat("grammar", 'root ::= "x"', "guided_grammar", "guided_grammar")),
        ({"structured_outputs": {"choice": ["a"]}},
         ResponseFormat("choice", '["a"]', *["structured_outputs.choice"] * 2)),
        ({"response_format": {"type": "json_object"}}, ResponseFormat("json_object")),
    ],
)  # fmt: skip
def test_each_field_is_carried_on_both_endpoints(extra, expected) -> None:
    assert parse_chat({"messages": CHAT, **extra}, CONFIG).response_format == expected
    assert parse_completion({"prompt": "x", **extra}, CONFIG).response_format == expected
    assert grammar_for(expected, None, "hermes") is not None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": [1]}, "guided_json"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_a_bad_or_second_constraint_is_a_400_naming_it(extra, param) -> None:
    with pytest.raises(RequestError) as info:
        parse_completion({"prompt": "x", **extra}, CONFIG)
    assert info.value.status == 400 and info.value.param == param


def test_a_constraint_xgrammar_refuses_is_a_400_naming_the_field() -> None:
    for kind, text, code in (("regex", "([a-", "invalid_regex"),
                             ("grammar", "root ::= missing", "invalid_grammar")):  # fmt: skip
        with pytest.raises(RequestError) as info:
            grammar_for(ResponseFormat(kind, text, param=f"guided_{kind}"), None, "hermes")
        assert (info.value.param, info.value.code) == (f"guided_{kind}", code)
    choice = grammar_for(ResponseFormat("choice", json.dumps(["café", 'a"b'])), None, "hermes")
    assert choice is not None and "caf" in choice.ebnf
