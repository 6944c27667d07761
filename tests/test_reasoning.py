"""vLLM's --reasoning-parser: a chat answer's <think> block as ``reasoning`` (and
``reasoning_content``), streamed and whole; where it starts decided by the prompt's end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai.types.chat import ChatCompletionMessageParam

from common.reasoning import CLOSED, OPEN, ReasoningSplitter, starts_inside, think_state
from common.wire.gateway import TextDelta, TextLogprob
from common.wire.tokenizer import ResponseFormat, ToolChoice, WireSamplingParams
from services.gateway.protocol import ApiRequest
from services.gateway.responses import ResponseBuilder
from tests.mesh import MeshHarness, openai_client
from tests.models import write_tiny_tokenizer


def split_all(pieces: list[str], opened: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(opened)
    reasoning = content = ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("<think>\nabc\n</think>\n\nThe answer", False, ("\nabc\n", "\n\nThe answer")),
        ("  \n<think>x</think>y", False, ("x", "y")),  # whitespace before the tag: dropped
        ("abc</think>\n\nanswer", True, ("abc", "\n\nanswer")),  # the prompt opened it
        ("all thought, cut short", True, ("all thought, cut short", "")),
        ("plain <think>not a block</think>", False, ("", "plain <think>not a block</think>")),
        ("<thin", False, ("", "<thin")),  # a tag's start, and the stream ended
        ("a </thin", True, ("a </thin", "")),
        ("<think>a</think>b</think>c", False, ("a", "b</think>c")),  # one block only
        ("", True, ("", "")),
    ],
)
def test_the_split_is_the_same_whole_and_a_character_at_a_time(
    text: str, opened: bool, expected: tuple[str, str]
) -> None:
    assert split_all([text], opened) == expected
    assert split_all(list(text), opened) == expected


def test_a_partial_tag_is_held_back_until_it_is_known() -> None:
    splitter = ReasoningSplitter(opened=True)
    assert splitter.feed("thinking </th") == ("thinking ", "")
    assert splitter.feed("ink>\nAnswer") == ("", "\nAnswer")
    splitter = ReasoningSplitter(opened=True)
    assert splitter.feed("a </th") == ("a ", "")
    assert splitter.feed("e end") == ("</the end", "")  # not the tag after all
    splitter = ReasoningSplitter(opened=False)
    assert splitter.feed("\n<th") == ("", "")
    assert splitter.feed("at is") == ("", "\n<that is")


@pytest.mark.parametrize(
    ("prompt", "think", "qwen3", "deepseek_r1"),
    [
        # DeepSeek-R1 distills, Qwen3-2507 thinking: the template opens the block
        ("<|im_start|>assistant\n<think>\n", OPEN, True, True),
        # Qwen3 with enable_thinking: false
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", CLOSED, False, False),
        # Qwen3: the model writes <think> itself; R1 thinks first whatever the template did
        ("<|im_start|>assistant\n", "", False, True),
        ("</think> then <think>", OPEN, True, True),
    ],
)
def test_the_prompt_says_whether_the_answer_starts_inside_the_block(
    prompt: str, think: str, qwen3: bool, deepseek_r1: bool
) -> None:
    assert think_state(prompt) == think
    assert starts_inside("qwen3", think) is qwen3
    assert starts_inside("deepseek_r1", think) is deepseek_r1


def chat_api(**fields: Any) -> ApiRequest:
    params = fields.pop("params", WireSamplingParams())
    return ApiRequest("chat", "m", 1, True, False, params, **fields)


def deltas(pieces: list[str], opened: bool) -> list[TextDelta]:
    last = len(pieces) - 1
    return [
        TextDelta(
            "r",
            piece,
            "stop" if i == last else None,
            logprobs=[TextLogprob(piece, -0.5, [])],
            think=OPEN if opened and i == 0 else "",
        )
        for i, piece in enumerate(pieces)
    ]


def streamed(builder: ResponseBuilder, items: list[TextDelta]) -> list[dict[str, Any]]:
    return [c["choices"][0] for d in items for c in builder.add(0, d)]


def test_chunks_carry_reasoning_then_content_and_the_response_both() -> None:
    pieces = ["Let me", " see.</th", "ink>\n\n", "Forty", "-two."]
    builder = ResponseBuilder(chat_api(params=WireSamplingParams(logprobs=0)), "id", 0, "", "qwen3")
    choices = streamed(builder, deltas(pieces, opened=True))
    shown = [c["delta"] for c in choices]
    assert shown[:2] == [
        {"reasoning": "Let me", "reasoning_content": "Let me"},
        {"reasoning": " see.", "reasoning_content": " see."},
    ]
    assert shown[2:] == [{"content": "\n\n"}, {"content": "Forty"}, {"content": "-two."}, {}]
    # every token's logprobs, in order, none on a chunk without text
    tokens = [e["token"] for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
    assert tokens == pieces
    message = builder.response()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "Let me see."
    assert message["content"] == "\n\nForty-two."


def test_the_delta_that_ends_the_block_carries_both() -> None:
    builder = ResponseBuilder(chat_api(), "id", 0, "", "qwen3")
    choices = streamed(builder, deltas(["<think>hm</think>Yes"], opened=False))
    assert choices[0]["delta"] == {"reasoning": "hm", "reasoning_content": "hm", "content": "Yes"}


def test_an_answer_cut_short_inside_the_block_has_no_content() -> None:
    builder = ResponseBuilder(chat_api(), "id", 0, "", "qwen3")
    streamed(builder, deltas(["still", " thinking"], opened=True))
    message = builder.response()["choices"][0]["message"]
    assert message["reasoning"] == "still thinking" and message["content"] is None


def test_without_a_block_the_answer_is_content_and_reasoning_null() -> None:
    builder = ResponseBuilder(chat_api(), "id", 0, "", "qwen3")
    choices = streamed(builder, deltas(["  Plain", " answer"], opened=False))
    assert "".join(c["delta"].get("content", "") for c in choices) == "  Plain answer"
    assert not any("reasoning" in c["delta"] for c in choices)
    message = builder.response()["choices"][0]["message"]
    assert message["content"] == "  Plain answer" and message["reasoning"] is None


def test_include_reasoning_false_leaves_it_out() -> None:
    builder = ResponseBuilder(chat_api(include_reasoning=False), "id", 0, "", "qwen3")
    choices = streamed(builder, deltas(["secret</think>", "Shown"], opened=True))
    assert not any("reasoning" in c["delta"] for c in choices)
    assert "".join(c["delta"].get("content", "") for c in choices) == "Shown"
    message = builder.response()["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] == "Shown"


def test_off_the_text_is_untouched_and_completions_are_never_split() -> None:
    builder = ResponseBuilder(chat_api(), "id", 0, "")
    streamed(builder, deltas(["a</think>b"], opened=True))
    assert builder.response()["choices"][0]["message"]["content"] == "a</think>b"
    completion = ApiRequest("completion", "m", 1, False, False, WireSamplingParams())
    builder = ResponseBuilder(completion, "id", 0, "", "qwen3")
    streamed(builder, deltas(["a</think>b"], opened=True))
    assert builder.response()["choices"][0]["text"] == "a</think>b"


def test_a_constrained_answer_reasons_first_where_its_grammar_waits() -> None:
    """vLLM's order: the grammar holds after the reasoning (the tokenizer gates it on
    ``</think>``), so the JSON or the forced call is what follows the block. Where the grammar
    held from the first token the tokenizer reports the block closed: all of it is content."""
    tools = json.dumps([{"type": "function", "function": {"name": "f"}}])
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    for api, answer in (
        (chat_api(response_format=ResponseFormat("json_object")), '{"a": 1}'),
        (chat_api(tools=ToolChoice(tools, "required")), call),
    ):
        builder = ResponseBuilder(api, "id", 0, "hermes", "qwen3")
        streamed(builder, deltas(["so: a.</think>\n\n", answer], opened=True))
        message = builder.response()["choices"][0]["message"]
        assert message["reasoning"] == "so: a."
        assert message["content"] == "\n\n" + answer or message["tool_calls"]
        builder = ResponseBuilder(api, "id", 0, "hermes", "qwen3")
        streamed(builder, [TextDelta("r", answer, "stop", think=CLOSED)])
        message = builder.response()["choices"][0]["message"]
        assert message["reasoning"] is None
        assert message["content"] == answer or message["tool_calls"]


def test_tool_calls_are_parsed_from_the_content_after_the_block() -> None:
    tools = json.dumps([{"type": "function", "function": {"name": "f"}}])
    builder = ResponseBuilder(chat_api(tools=ToolChoice(tools)), "id", 0, "hermes", "qwen3")
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    streamed(builder, deltas(["I should call f.</think>\n\n", call], opened=True))
    choice = builder.response()["choices"][0]
    assert choice["message"]["reasoning"] == "I should call f."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["f"]
    assert choice["finish_reason"] == "tool_calls"


def test_deepseek_r1_thinks_first_unless_the_prompt_closed_the_block() -> None:
    """vLLM's deepseek_r1: a bare </think> ends reasoning the prompt's template did not show
    opening (an older R1 template, or one that opens it out of this parser's sight)."""
    builder = ResponseBuilder(chat_api(), "id", 0, "", "deepseek_r1")
    streamed(builder, deltas(["so it is 4.</think>\n\n", "4"], opened=False))
    message = builder.response()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("so it is 4.", "\n\n4")
    closed = ResponseBuilder(chat_api(), "id", 0, "", "deepseek_r1")
    first = TextDelta("r", "4", "stop", think=CLOSED)
    streamed(closed, [first])
    message = closed.response()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (None, "4")


def test_after_a_prompt_that_closed_the_block_a_leading_tag_is_content() -> None:
    """vLLM takes the whole output as content where the prompt ended the reasoning."""
    splitter = ReasoningSplitter(False, closed=True)
    assert splitter.feed("<think>x</think>y") == ("", "<think>x</think>y")


def test_the_tokenizer_gates_a_grammar_as_the_prompt_and_the_parser_say(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Open block: after </think>; no tag under qwen3: after </think> if the model opens the
    block first; closed, or a vocabulary without the tags: from the first token, reported
    closed (no reasoning)."""
    from common.config import MeshConfig
    from common.tokenizer import Tokenizer
    from common.wire.executor import WireGrammar
    from services.tokenizer.service import TokenizerConfig, TokenizerService

    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    write_tiny_tokenizer(folder, 512, THINKING_TEMPLATE, added=("<think>", "</think>"))
    tok = Tokenizer.from_folder(folder)
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    grammar = WireGrammar("k", "root ::= [a-z]+")
    service = TokenizerService(TokenizerConfig(MeshConfig(), str(folder)))
    gate = service.after_reasoning
    assert gate(grammar, "qwen3", OPEN) == (WireGrammar("k", grammar.ebnf, end), OPEN)
    assert gate(grammar, "qwen3", "") == (WireGrammar("k", grammar.ebnf, end, start), "")
    assert gate(grammar, "deepseek_r1", "") == (WireGrammar("k", grammar.ebnf, end), "")
    assert gate(grammar, "qwen3", CLOSED) == (grammar, CLOSED)
    plain = TokenizerService(TokenizerConfig(MeshConfig(), str(tiny_llama)))
    assert plain.think_end is None and plain.after_reasoning(grammar, "qwen3", OPEN) == (
        grammar,
        CLOSED,
    )


def test_a_think_tag_the_model_writes_inside_an_open_block_is_dropped() -> None:
    assert split_all(["\n<th", "ink>\nhm</think>A"], opened=True) == ("\nhm", "A")
    assert split_all(["\nhm <think>"], opened=True) == ("\nhm <think>", "")  # not first


def test_the_reasoning_goes_out_before_the_calls_of_the_same_delta() -> None:
    tools = json.dumps([{"type": "function", "function": {"name": "f"}}])
    builder = ResponseBuilder(chat_api(tools=ToolChoice(tools)), "id", 0, "hermes", "qwen3")
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    choices = streamed(builder, deltas([f"hmm</think>\n\n{call}"], opened=True))
    kinds = [
        "reasoning" if "reasoning" in c["delta"] else next(iter(c["delta"]), "end") for c in choices
    ]
    assert kinds[0] == "reasoning" and "tool_calls" in kinds[1:]
    assert kinds.index("tool_calls") > 0


def test_left_out_reasoning_takes_its_logprobs_with_it() -> None:
    params = WireSamplingParams(logprobs=0)
    api = chat_api(include_reasoning=False, params=params)
    builder = ResponseBuilder(api, "id", 0, "", "qwen3")
    choices = streamed(builder, deltas(["a", "b", "c</think>", "X"], opened=True))
    sent = [(c["delta"].get("content"), c["logprobs"]) for c in choices if c["logprobs"]]
    assert [(text, [e["token"] for e in lp["content"]]) for text, lp in sent] == [("X", ["X"])]


# --------------------------------------------------------------------------- through the mesh

# DeepSeek-R1's and Qwen3-2507's way: the template opens the block unless thinking is off,
# where it closes it at once (Qwen3's enable_thinking: false)
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}"
)
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def mesh(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_llama, folder)
    # Qwen3's way: each tag is one token, decoded as text
    write_tiny_tokenizer(folder, 512, THINKING_TEMPLATE, added=("<think>", "</think>"))
    harness = MeshHarness(folder, gateway_options={"reasoning_parser": "qwen3"}).start()
    yield harness
    harness.stop()


async def plain_completion(mesh: MeshHarness, body: dict[str, Any]) -> str:
    """The same prompt's greedy text, unsplit: /tokenize's ids through /v1/completions."""
    root = mesh.base_url.removesuffix("/v1")
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{root}/tokenize", json=body) as resp:
            ids = (await resp.json())["tokens"]
        request = {"prompt": ids, "max_tokens": 8, "temperature": 0, "model": "tiny"}
        async with session.post(f"{mesh.base_url}/completions", json=request) as resp:
            assert resp.status == 200
            return str((await resp.json())["choices"][0]["text"])


async def test_a_prompt_that_opens_the_block_makes_the_answer_reasoning(mesh) -> None:
    """The tiny model never writes </think>: its whole answer is the reasoning, streamed
    as such and whole, with no content."""
    client = openai_client(mesh.base_url)
    expected = await plain_completion(mesh, {"messages": USER})
    assert expected
    whole = await client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=8,
        temperature=0,
    )
    message = whole.model_dump()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == expected
    assert message["content"] is None
    stream = await client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    reasoning = content = ""
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta.model_dump()
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
    assert (reasoning, content) == (expected, "")
    await client.close()


async def test_a_prompt_that_closes_the_block_makes_the_answer_content(mesh) -> None:
    client = openai_client(mesh.base_url)
    off = {"enable_thinking": False}
    expected = await plain_completion(mesh, {"messages": USER, "chat_template_kwargs": off})
    whole = await client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": off},
    )
    message = whole.model_dump()["choices"][0]["message"]
    assert message["content"] == expected and message["reasoning"] is None
    await client.close()


async def test_a_grammar_holds_after_the_reasoning_as_vllm_orders_them(mesh) -> None:
    """With the block open, a constrained answer reasons freely first: a token its grammar
    forbids (forced by logit_bias) is reasoning, and no content comes before ``</think>``;
    once the model ends the block (``</think>`` forced) the answer is the grammar's. With
    the block closed the grammar holds from the first token, all of it content."""
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(mesh.model)
    (end,) = tok.encode("</think>", add_special_tokens=False)
    z = tok.encode("zz", add_special_tokens=False)[0]
    client = openai_client(mesh.base_url)
    choice = {"structured_outputs": {"choice": ["yes", "no"]}}

    async def ask(bias: int, **extra: Any) -> Any:
        out = await client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=6, temperature=0,
            logit_bias={str(bias): 100}, extra_body={**choice, **extra},
        )  # fmt: skip
        return out.choices[0]

    reasoning = await ask(z)
    message = reasoning.message.model_dump()
    assert message["reasoning"] == tok.decode([z] * 6) and message["content"] is None
    assert reasoning.finish_reason == "length"
    answered = await ask(end)
    message = answered.message.model_dump()
    assert message["reasoning"] == "" or message["reasoning"] is None
    assert message["content"] in ("yes", "no") and answered.finish_reason == "stop"
    closed = await ask(z, chat_template_kwargs={"enable_thinking": False})
    message = closed.message.model_dump()
    assert message["content"] in ("yes", "no") and message["reasoning"] is None
    await client.close()
