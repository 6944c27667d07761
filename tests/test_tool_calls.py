"""Tool-call formats: chosen from the chat template, parsed out of streamed text."""

from __future__ import annotations

import json

import pytest

from common.tool_formats import HERMES, LLAMA3_JSON, MISTRAL, detect_tool_format
from services.gateway.tool_calls import CallDelta, ToolCall, ToolCallParser
from tests.models import CHATML, QWEN_TOOLS

NAMES = {"get_weather", "get_time"}


def test_format_follows_the_chat_template():
    assert detect_tool_format(QWEN_TOOLS) == HERMES
    assert detect_tool_format(CHATML) == HERMES  # no tool format: the hermes default
    llama31 = "{{- '<|start_header_id|>ipython<|end_header_id|>' }}{{- '<|python_tag|>' }}"
    assert detect_tool_format(llama31) == LLAMA3_JSON


def feed_all(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    """The content, and the calls as a client rebuilds them from the deltas (checked against
    the parser's own record)."""
    text, deltas = "", list[CallDelta]()
    for piece in pieces:
        t, d = parser.feed(piece)
        text, deltas = text + t, deltas + d
    t, d = parser.finish()
    text, deltas = text + t, deltas + d
    calls: list[ToolCall] = []
    for delta in deltas:
        if delta.id:
            assert delta.index == len(calls)
            calls.append(ToolCall(delta.id, delta.name, ""))
        calls[delta.index].arguments += delta.arguments
    assert calls == parser.calls
    return text, calls


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_hermes_calls_split_anywhere_in_the_stream(size):
    out = (
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    )
    text, calls = feed_all(ToolCallParser(HERMES, NAMES), pieces_of(out, size))
    assert text == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_hermes_text_after_a_call_keeps_its_whitespace_however_it_is_split(size):
    """Whitespace pieces after a call were dropped per feed: prose after a call lost its
    spaces and newlines when they came as tokens of their own, and kept them in one chunk.
    Whitespace between and after calls is still layout."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    out = f"\n{call}\n{call}\nLine one.\n\nLine two. 42\n\n"
    text, calls = feed_all(ToolCallParser(HERMES, NAMES), pieces_of(out, size))
    assert len(calls) == 2 and text == "\nLine one.\n\nLine two. 42"
    text, calls = feed_all(ToolCallParser(HERMES, NAMES), pieces_of(f"{call} \n", size))
    assert len(calls) == 1 and text == ""
    plain = "No call here.\n\n"  # without calls, trailing whitespace is the text's
    assert feed_all(ToolCallParser(HERMES, NAMES), pieces_of(plain, size)) == (plain, [])


def test_hermes_arguments_stream_before_the_call_ends():
    parser = ToolCallParser(HERMES, NAMES)
    _, opened = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(d.name, d.arguments) for d in opened] == [("get_weather", ""), ("", '{"city": "Pa')]
    _, more = parser.feed('r}is"}}\n</tool_c')
    assert [d.arguments for d in more] == ['r}is"}']  # a brace inside a string is text
    assert parser.finish() == ("", [])
    assert json.loads(parser.calls[0].arguments) == {"city": "Par}is"}


def test_hermes_text_that_is_no_call_stays_content():
    out = 'a < b <tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call> <tool_c'
    text, calls = feed_all(ToolCallParser(HERMES, NAMES), pieces_of(out, 2))
    assert calls == [] and text == out


@pytest.mark.parametrize("size", [1, 1000])
def test_llama3_json_calls(size):
    out = (
        '{"name": "get_time", "parameters": {"zone": "CET"}}; '
        '{"name": "get_weather", "parameters": {"city": "a;b"}}'
    )
    text, calls = feed_all(ToolCallParser(LLAMA3_JSON, NAMES), pieces_of(out, size))
    assert text == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "CET"}),
        ("get_weather", {"city": "a;b"}),
    ]
    text, calls = feed_all(ToolCallParser(LLAMA3_JSON, NAMES), ["It is ", "sunny."])
    assert (text, calls) == ("It is sunny.", [])


# Mistral v0.3's template as its tokenizer_config.json has it, cut to the parts that matter
MISTRAL_V03 = (
    "{%- if tools is not none and (message == user_messages[-1]) %}"
    "{{- '[AVAILABLE_TOOLS] [' }}{{- '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if not tool_call.id is defined or tool_call.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{%- endfor %}{{- '[TOOL_CALLS] [' }}"
)


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_mistral_calls(size):
    """Mistral's format was taken for hermes: its calls came back as content, and their ids
    (call_ + 24 hex) made its template refuse the conversation's next turn."""
    assert detect_tool_format(MISTRAL_V03) == MISTRAL
    out = (
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "CET"}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    )
    for written in (out, out.removeprefix("[TOOL_CALLS] ")):  # the marker is a special token
        text, calls = feed_all(ToolCallParser(MISTRAL, NAMES), pieces_of(written, size))
        assert text == ""
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_time", {"zone": "CET"}),
            ("get_weather", {"city": "Oslo"}),
        ]
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    text, calls = feed_all(ToolCallParser(MISTRAL, NAMES), ["[Note] it ", "is sunny."])
    assert (text, calls) == ("[Note] it is sunny.", [])  # not calls: content, as written


def test_a_forced_mistral_call_is_an_array_of_calls():
    from common.wire.tokenizer import ToolChoice
    from services.tokenizer.grammars import grammar_for

    tools = json.dumps([{"type": "function", "function": {"name": "get_time"}}])
    grammar = grammar_for(None, ToolChoice(tools, "required"), MISTRAL)
    assert grammar is not None and '"["' in grammar.ebnf


@pytest.mark.parametrize("tool_format", [HERMES, LLAMA3_JSON, MISTRAL])
def test_a_required_tool_choice_allows_parallel_calls_unless_they_are_turned_off(tool_format):
    """``required`` forced exactly one call in hermes and llama3_json: a model that wanted the
    weather in two cities had to leave one out. ``parallel_tool_calls: false`` and a named
    function keep to one; nothing but calls is allowed either way."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from common.tool_formats import arguments_key
    from common.wire.tokenizer import ToolChoice
    from services.tokenizer.grammars import grammar_for

    tools = json.dumps(
        [
            {"type": "function", "function": {"name": "get_time"}},
            {"type": "function", "function": {"name": "get_weather"}},
        ]
    )
    key = arguments_key(tool_format)
    a = f'{{"name": "get_time", "{key}": {{}}}}'
    b = f'{{"name": "get_weather", "{key}": {{}}}}'
    if tool_format == HERMES:
        one, two = (
            f"<tool_call>\n{a}\n</tool_call>",
            f"<tool_call>\n{a}\n</tool_call>\n<tool_call>\n{b}\n</tool_call>",
        )
    elif tool_format == LLAMA3_JSON:
        one, two = a, f"{a}; {b}"
    else:
        one, two = f"[{a}]", f"[{a}, {b}]"

    def accepts(choice: ToolChoice, text: str) -> bool:
        grammar = grammar_for(None, choice, tool_format)
        assert grammar is not None
        return _is_grammar_accept_string(xgr.Grammar.from_ebnf(grammar.ebnf), text)

    required = ToolChoice(tools, "required")
    assert accepts(required, one) and accepts(required, two)
    assert not accepts(required, "") and not accepts(required, one + " and some text")
    single = ToolChoice(tools, "required", parallel=False)
    assert accepts(single, one) and not accepts(single, two)
    named = ToolChoice(tools, "function", "get_time")
    assert accepts(named, one) and not accepts(named, two)
    assert not accepts(named, one.replace("get_time", "get_weather"))


def test_logprobs_go_out_with_the_text_the_parser_held_back():
    """A whitespace token could open a hermes call: the parser holds its text back, and its
    logprobs wait with it, out with the next content (never a chunk of logprobs and no text),
    and the ones still held go out at the end."""
    from common.wire.gateway import TextDelta, TextLogprob
    from common.wire.tokenizer import ToolChoice, WireSamplingParams
    from services.gateway.protocol import ApiRequest
    from services.gateway.responses import ResponseBuilder

    tools = json.dumps([{"type": "function", "function": {"name": "f"}}])
    api = ApiRequest(
        "chat", "m", 1, True, False, WireSamplingParams(logprobs=0), tools=ToolChoice(tools)
    )
    builder = ResponseBuilder(api, "id", 0, "hermes")
    sent: list[tuple[str, list[str]]] = []
    for i, token in enumerate(["Hello", "\n", " there", "\n"]):
        finish = "stop" if i == 3 else None
        delta = TextDelta("r", token, finish, logprobs=[TextLogprob(token, -0.5, [])])
        for chunk in builder.add(0, delta):
            choice = chunk["choices"][0]
            if choice.get("logprobs"):
                content = choice["delta"].get("content", "")
                sent.append((content, [e["token"] for e in choice["logprobs"]["content"]]))
    assert all(text for text, _ in sent[:-1])  # only the end may flush logprobs without text
    assert [t for _, tokens in sent for t in tokens] == ["Hello", "\n", " there", "\n"]
    assert "".join(text for text, _ in sent) == "Hello\n there\n"
