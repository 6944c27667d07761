"""Constrained decoding in the engine: the grammar mask, logit_bias, and speculative drafts
checked against the grammar (a draft token the grammar rejects is never accepted, and the
matcher rolls back so later masks are right)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from common.runtime import RequestError
from common.tokenizer import Tokenizer
from common.wire.tokenizer import ResponseFormat, ToolChoice
from gpu.engine import Engine, EngineConfig
from gpu.loader import load_model
from gpu.runner import ModelRunner
from gpu.sampling_params import SamplingParams
from gpu.spec_decode import Proposal
from services.executor.grammars import tokenizer_info
from services.tokenizer.grammars import grammar_for

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["color", "ok", "tags"],
}


@pytest.fixture(scope="module")
def parts(tiny_llama):
    import xgrammar as xgr

    tok = Tokenizer.from_folder(tiny_llama)
    model = load_model(tiny_llama, progress=False)
    info = tokenizer_info(tok.backend, model.config.vocab_size, list(tok.eos_token_ids))
    wire = grammar_for(ResponseFormat("json_schema", json.dumps(SCHEMA)), None, "hermes")
    assert wire is not None
    compiled = xgr.GrammarCompiler(info).compile_grammar(wire.ebnf)
    return tok, model, compiled


def make_engine(model, tok, k: int = 0, overlap: bool = False) -> Engine:
    config = EngineConfig(num_speculative_tokens=k, overlap_steps=overlap)
    return Engine(ModelRunner(model, 128, 16), config, tok.eos_token_ids)


def valid(tok, ids: list[int]) -> Any:
    value = json.loads(tok.decode(ids))
    jsonschema.validate(value, SCHEMA)
    return value


def run(engine: Engine, rid: str) -> list[int]:
    out: list[int] = []
    while rid in engine.seqs:
        for o in engine.step():
            if o.request_id == rid:
                out += o.new_token_ids
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_output_validates_and_the_unconstrained_neighbour_is_untouched(
    parts, temperature
):
    tok, model, compiled = parts
    prompt = tok.encode_user_turn("Describe the sky as JSON.")
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=120)
    free = make_engine(model, tok).generate([prompt], params)[0]
    engine = make_engine(model, tok)
    engine.add_request("free", prompt, params)
    engine.add_request("json", prompt, params, grammar=compiled)
    outs: dict[str, list[int]] = {"free": [], "json": []}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    valid(tok, outs["json"][:-1])  # the last token is the end of sequence the grammar asked for
    assert outs["json"][-1] in tok.eos_token_ids
    assert outs["free"] == free  # same batch, no grammar: exactly what it samples alone


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlapped_steps_follow_the_grammar_as_plain_steps_do(parts, temperature):
    """The next step's mask is built once the last token is read back: the same document."""
    tok, model, compiled = parts
    prompt = tok.encode_user_turn("Describe the sky as JSON.")
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=120)
    outs = []
    for overlap in (False, True):
        engine = make_engine(model, tok, overlap=overlap)
        engine.add_request("json", prompt, params, grammar=compiled)
        outs.append(run(engine, "json"))
        assert engine.pages.num_free == engine.pages.num_pages
    assert outs[1] == outs[0]
    valid(tok, outs[1][:-1])


def test_logit_bias_bans_and_forces(parts):
    tok, model, _ = parts
    prompt = tok.encode_user_turn("hello")
    engine = make_engine(model, tok)
    forced = tok.encode("fox")[0]
    out = engine.generate(
        [prompt], SamplingParams(seed=1, max_tokens=6, logit_bias=((forced, 100.0),))
    )
    assert out[0] == [forced] * 6
    allowed = tok.encode("ab")[:2]
    banned = tuple((t, -100.0) for t in range(model.config.vocab_size) if t not in allowed)
    out = engine.generate([prompt], SamplingParams(seed=1, max_tokens=12, logit_bias=banned))
    assert set(out[0]) <= set(allowed), out
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("x", prompt, SamplingParams(logit_bias=((10**6, 1.0),)))


def test_a_draft_the_grammar_rejects_is_not_accepted_and_the_matcher_rolls_back(parts):
    tok, model, compiled = parts
    prompt = tok.encode_user_turn("sky")
    greedy = SamplingParams(temperature=0.0, max_tokens=120)
    plain = make_engine(model, tok)
    plain.add_request("r", prompt, greedy, grammar=compiled)
    expected = run(plain, "r")
    valid(tok, expected[:-1])

    engine = make_engine(model, tok, k=3)
    engine.add_request("r", prompt, greedy, grammar=compiled)
    got: list[int] = []
    bad = tok.encode("zzz")[:3]  # no JSON document starts with z, nor continues with it here
    step = 0
    while "r" in engine.seqs:
        asked = {r.request_id: r.num_draft for r in engine.draft_requests()}
        if "r" in asked:
            pos = len(got)
            # Alternate: a draft the grammar rejects, then the true continuation (accepted).
            draft = bad if step % 2 == 0 else expected[pos : pos + asked["r"]]
            engine.set_drafts({"r": Proposal(list(draft)[: asked["r"]])})
            before = engine.spec.num_accepted_tokens
            outs = engine.step()
            if step % 2 == 0:
                assert engine.spec.num_accepted_tokens == before  # z is never accepted
            step += 1
        else:
            outs = engine.step()
        for o in outs:
            got += o.new_token_ids
    assert got == expected  # greedy with a grammar is lossless under speculation
    assert engine.spec.num_accepted_tokens > 0


def test_migrated_tokens_advance_the_grammar(parts):
    tok, model, compiled = parts
    prompt = tok.encode_user_turn("sky")
    greedy = SamplingParams(temperature=0.0, max_tokens=120)
    engine = make_engine(model, tok)
    engine.add_request("a", prompt, greedy, grammar=compiled)
    full = run(engine, "a")
    engine.add_request("b", prompt, greedy, output_token_ids=full[:4], grammar=compiled)
    assert full[:4] + run(engine, "b") == full
    with pytest.raises(ValueError, match="grammar"):
        engine.add_request("c", prompt, greedy, output_token_ids=tok.encode("zz"), grammar=compiled)


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "object", "properties": [1]},
        {"type": "object", "properties": "x"},
        {"anyOf": 5},
        {"type": "object", "properties": {"a": {"oneOf": {"type": "string"}}}},
    ],
)
def test_a_malformed_schema_is_a_400_not_a_crash(bad: dict[str, Any]) -> None:
    """xgrammar refuses these; finding the part to name must not raise on the client's
    malformed keywords (an AttributeError here was a 500)."""
    with pytest.raises(RequestError) as info:
        grammar_for(ResponseFormat("json_schema", json.dumps(bad)), None, "hermes")
    assert info.value.status == 400 and info.value.code == "invalid_schema"
    tools = json.dumps([{"type": "function", "function": {"name": "f", "parameters": bad}}])
    with pytest.raises(RequestError) as info:
        grammar_for(None, ToolChoice(tools, "required"), "hermes")
    assert info.value.status == 400 and info.value.param == "tools"


def allowed(bitmask: Any, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def test_a_grammar_after_reasoning_allows_everything_until_its_token(parts):
    """``after_token`` (a reasoning model's ``</think>``): every token goes, none reaches the
    matcher, until that one; then the grammar's first mask. A draft that crosses the token
    gets free rows before it and the grammar's after it, and leaves the state as it was."""
    from gpu.grammar import GrammarState, allocate_bitmask

    tok, model, compiled = parts
    vocab = model.config.vocab_size
    z, brace = tok.encode("zz")[0], tok.encode("{")[0]
    end = tok.encode("fox")[0]  # (stands for </think>)
    state = GrammarState(compiled, sorted(tok.eos_token_ids), after_token=end)
    bitmask = allocate_bitmask(6, vocab)
    bitmask.zero_()
    state.draft_masks([z, end, z, brace], bitmask, 0)
    assert allowed(bitmask, 0, z) and allowed(bitmask, 1, z)  # still reasoning
    assert not allowed(bitmask, 2, z) and allowed(bitmask, 2, brace)  # the document starts
    assert int(bitmask[3].abs().sum()) == 0  # past the rejected z: not filled
    assert state.waiting_for == end  # the walk committed nothing
    assert state.accept([z, z, brace])  # any token while reasoning, the brace too
    assert state.waiting_for == end
    assert state.accept([end])
    state.next_mask(bitmask, 4)
    assert state.waiting_for is None and allowed(bitmask, 4, brace)
    assert not allowed(bitmask, 4, z) and not state.accept([z])


def test_the_engine_runs_the_reasoning_free_and_the_answer_constrained(parts):
    """With ``grammar_after``: a token the grammar forbids (forced by logit_bias) is emitted
    while the model reasons; a continuation that reasoned and then ended the block goes on
    under the grammar: what follows the end token is a valid document."""
    tok, model, compiled = parts
    prompt = tok.encode_user_turn("sky")
    z, end = tok.encode("zz")[0], tok.encode("fox")[0]
    engine = make_engine(model, tok)
    forced = SamplingParams(temperature=0.0, max_tokens=5, logit_bias=((z, 100.0),))
    engine.add_request("free", prompt, forced, grammar=compiled, grammar_after=end)
    assert run(engine, "free") == [z] * 5  # the grammar never started
    engine.add_request("held", prompt, forced, grammar=compiled)
    assert z not in run(engine, "held")  # (without the gate z is masked from the first token)
    greedy = SamplingParams(temperature=0.0, max_tokens=120)
    reasoned = [z, z, end]
    with pytest.raises(ValueError, match="grammar"):
        engine.add_request("c", prompt, greedy, output_token_ids=reasoned, grammar=compiled)
    engine.add_request("c", prompt, greedy, output_token_ids=reasoned, grammar=compiled,
                       grammar_after=end)  # fmt: skip
    answer = run(engine, "c")
    valid(tok, answer[:-1])
    assert answer[-1] in tok.eos_token_ids


def test_a_model_may_open_its_block_first_and_then_the_grammar_waits(parts):
    """``open_token`` (Qwen3's own templates, no tag in the prompt): the first mask is the
    grammar's with the opening tag allowed too; the tag first makes the grammar wait for the
    end tag, anything else starts the document at once (and the tag is no longer allowed)."""
    from gpu.grammar import GrammarState, allocate_bitmask

    tok, model, compiled = parts
    vocab = model.config.vocab_size
    z, brace = tok.encode("zz")[0], tok.encode("{")[0]
    start, end = tok.encode("fox")[0], tok.encode("dog")[0]  # (stand for <think>, </think>)
    stops = sorted(tok.eos_token_ids)
    bitmask = allocate_bitmask(4, vocab)
    opened = GrammarState(compiled, stops, after_token=end, open_token=start)
    assert opened.next_mask(bitmask, 0)  # the first mask: the grammar's, and the tag
    assert allowed(bitmask, 0, start) and allowed(bitmask, 0, brace)
    assert not allowed(bitmask, 0, z)
    assert opened.accept([start, z, z]) and opened.waiting_for == end
    assert not opened.next_mask(bitmask, 1) and allowed(bitmask, 1, z)
    assert opened.accept([end]) and opened.next_mask(bitmask, 2)
    assert not allowed(bitmask, 2, z) and not allowed(bitmask, 2, start)
    direct = GrammarState(compiled, stops, after_token=end, open_token=start)
    assert direct.accept([brace]) and direct.waiting_for is None
    direct.next_mask(bitmask, 3)
    assert not allowed(bitmask, 3, start)
    assert not GrammarState(compiled, stops, after_token=end, open_token=start).accept([z])
    # a draft that opens and closes the block: free rows inside, the grammar's after
    walk = GrammarState(compiled, stops, after_token=end, open_token=start)
    assert walk.draft_masks([start, z, end, brace], allocate_bitmask(5, vocab), 0) == [0, 3, 4]
    assert walk.gate == (start, None)  # nothing committed


def test_min_tokens_holds_while_the_model_reasons(parts):
    """A row whose grammar waits is free, not constrained: min_tokens still bans the stop
    tokens there (a constrained row leaves them to the grammar)."""
    tok, model, compiled = parts
    prompt = tok.encode_user_turn("sky")
    (eos,) = sorted(tok.eos_token_ids)[:1]
    end = tok.encode("fox")[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=5,
                            logit_bias=((eos, 100.0),))  # fmt: skip
    engine = make_engine(model, tok)
    plain = engine.generate([prompt], params)[0]
    engine.add_request("gated", prompt, params, grammar=compiled, grammar_after=end)
    gated = run(engine, "gated")
    assert gated == plain and len(gated) == 6 and gated[-1] == eos
