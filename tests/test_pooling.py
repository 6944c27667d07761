"""Embeddings in the engine (``gpu/pooling.py``): the last token's, the mean and the first
token's final hidden state against transformers' base model, through chunked prefill, a
cached prefix, a batch shared with decoding sequences, preemption midway, the overlapped loop
and the fused CPU decode step; Matryoshka cuts and normalization; the model's pooling read
from its sentence-transformers files (``gpu/pooler_config.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu.engine import Engine
from gpu.loader import load_model
from gpu.model import CausalLM
from gpu.pooler_config import PoolerConfig, PoolingError
from gpu.pooling import PromptPooling
from gpu.sampling_params import SamplingParams
from gpu.scheduler import Scheduler
from gpu.sequence import Sequence
from tests.engine_helpers import engine_for, prompt
from tests.engine_helpers import run as run_requests
from tests.models import hf_model


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> CausalLM:
    return load_model(tiny_llama, progress=False)


@pytest.fixture(scope="module")
def oracle(tiny_llama: Path) -> Any:
    return hf_model(tiny_llama)


def embed(mode: str, dims: int | None = None, normalize: bool = True) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=1,
        ignore_eos=True,
        pooling=mode,
        pooling_dimensions=dims,
        pooling_normalize=normalize,
    )


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    return run_requests(engine, requests, "embedding")


def expected(
    oracle: Any, ids: list[int], mode: str, dims: int | None = None, normalize: bool = True
) -> torch.Tensor:
    """transformers' base model (its last_hidden_state is after the final norm), pooled."""
    with torch.no_grad():
        hidden = oracle.model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[mode]
    vector = vector[:dims] if dims is not None else vector
    return F.normalize(vector, dim=0) if normalize else vector


def assert_close(got: list[float] | None, want: torch.Tensor) -> None:
    assert got is not None and len(got) == want.shape[0]
    torch.testing.assert_close(torch.tensor(got), want, atol=2e-5, rtol=1e-4)


def test_each_pooling_matches_transformers_through_chunks_and_a_cached_prefix(
    model: CausalLM, oracle: Any
) -> None:
    """A 45-token prompt in 16-token chunks, its prefix cached by an earlier request, beside a
    sequence that decodes: last-token pooling takes the cached prefix, mean and CLS compute
    every position; the decoding sequence's tokens are those it has alone."""
    engine = engine_for(model)
    ids = prompt(1, 45)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = run(engine, {"warm": (ids, greedy), "other": (prompt(2, 9), greedy)})
    both = run(
        engine,
        {
            "last": (ids, embed("last")),
            "mean": (ids, embed("mean")),
            "cls": (ids, embed("cls")),
            "other2": (prompt(2, 9), greedy),
        },
    )
    first = both["first"]
    assert first["last"].cached_tokens == 44 and first["mean"].cached_tokens == 0
    assert first["cls"].cached_tokens == 0 and first["other2"].embedding is None
    for mode in ("last", "mean", "cls"):
        assert_close(first[mode].embedding, expected(oracle, ids, mode))
        assert first[mode].finish_reason == "length" and len(both["tokens"][mode]) == 1
    assert both["tokens"]["other2"] == alone["tokens"]["other"]
    assert engine.pages.num_free == engine.pages.num_pages and not engine.seqs


def test_matryoshka_cut_and_no_normalization(model: CausalLM, oracle: Any) -> None:
    """The vector is cut to its first ``dimensions`` before it is normalized (vLLM's order);
    without normalization it is the raw pooled state."""
    ids = prompt(3, 20)
    got = run(
        engine_for(model),
        {
            "cut": (ids, embed("mean", dims=16)),
            "raw": (ids, embed("last", normalize=False)),
        },
    )["first"]
    assert_close(got["cut"].embedding, expected(oracle, ids, "mean", dims=16))
    raw = expected(oracle, ids, "last", normalize=False)
    assert_close(got["raw"].embedding, raw)
    assert abs(float(raw.norm()) - 1.0) > 0.1  # (so the test tells the two apart)


def test_overlapped_steps_and_a_one_token_prompt(model: CausalLM, oracle: Any) -> None:
    """The overlapped loop pools the same; a prompt of one token (a step the fused CPU decode
    path may take) is its own last, mean and first token."""
    ids = prompt(4, 30)
    requests = {"a": (ids, embed("mean")), "b": ([7], embed("last")), "c": ([7], embed("cls"))}
    over = run(engine_for(model, overlap=True), requests)["first"]
    assert_close(over["a"].embedding, expected(oracle, ids, "mean"))
    for rid in ("b", "c"):
        assert_close(over[rid].embedding, expected(oracle, [7], "last"))


def test_a_sequence_preempted_midway_pools_each_position_once(
    model: CausalLM, oracle: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool too small for two long prompts preempts one while it pools the mean; recomputed
    from its first token, it pools the positions it had not and none twice."""
    engine = engine_for(model, budget=8, num_pages=14)
    a, b = prompt(5, 26), prompt(6, 26)
    midway: list[int] = []
    preempt = Scheduler._preempt

    def spy(self: Scheduler, seq: Sequence) -> None:
        if seq.pooling is not None:
            midway.append(seq.pooling.taken)
        preempt(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    result = run(engine, {"b": (b, greedy), "a": (a, embed("mean"))})
    assert midway and all(0 < n < 26 for n in midway)
    assert_close(result["first"]["a"].embedding, expected(oracle, a, "mean"))


def test_the_fused_cpu_decode_step_hands_back_the_tap(
    model: CausalLM, oracle: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-token embedding joining a decoding sequence: an all-decode step, which the fused
    CPU decoder runs (one C call); its last-token vector is still transformers'."""
    engine = engine_for(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("d", prompt(8, 9), greedy)
    engine.step()  # d's prompt: it decodes from here on
    fused = model.fused_decoder()
    if fused is None:
        pytest.skip("the CPU kernels did not build: no fused decode step")
    rows: list[int] = []

    def spy(hidden: torch.Tensor, *args: Any) -> Any:
        rows.append(hidden.shape[0])
        return fused(hidden, *args)

    monkeypatch.setattr(model, "fused_decoder", lambda: spy)
    got = run(engine, {"e": ([11], embed("last"))})
    assert 2 in rows  # (d's decode and e's one-token prompt in one fused call)
    assert_close(got["first"]["e"].embedding, expected(oracle, [11], "last"))


def test_an_input_may_fill_the_context(model: CausalLM, oracle: Any) -> None:
    """Its one token is never computed: a prompt of the whole context embeds (a generating
    one must leave room for a token)."""
    engine = engine_for(model, budget=64, num_pages=256)
    ids = prompt(9, engine.max_seq_len)
    got = run(engine, {"full": (ids, embed("mean"))})["first"]["full"]
    assert_close(got.embedding, expected(oracle, ids, "mean"))
    with pytest.raises(ValueError, match="room for one output token"):
        engine.add_request("gen", ids, SamplingParams(max_tokens=1))


@pytest.mark.parametrize("kind", ["qwen3", "qwen2_moe"])
def test_other_architectures(tiny_models: dict[str, Path], kind: str) -> None:
    """Qwen3 (head norms; what Qwen3-Embedding is) and a mixture of experts pool as
    transformers' base models do."""
    folder = tiny_models[kind]
    engine = engine_for(load_model(folder, progress=False))
    ids = prompt(7, 21)
    got = run(engine, {"last": (ids, embed("last")), "mean": (ids, embed("mean"))})["first"]
    oracle = hf_model(folder)
    for mode in ("last", "mean"):
        assert_close(got[mode].embedding, expected(oracle, ids, mode))


def test_requests_the_engine_refuses(model: CausalLM) -> None:
    engine = engine_for(model)
    with pytest.raises(ValueError, match="more than the model's hidden size"):
        engine.add_request("big", [5, 6], embed("last", dims=model.config.hidden_size + 1))
    with pytest.raises(ValueError, match="pooling must be one of"):
        SamplingParams(pooling="max")
    with pytest.raises(ValueError, match="pooling_dimensions"):
        SamplingParams(pooling="last", pooling_dimensions=0)


def test_positions_each_chunk_pools() -> None:
    """Last: the prompt's last position, in the chunk that holds it; mean: each position not
    yet pooled; CLS: the first position, once; none past the prompt (decoding)."""
    last, mean, cls = PromptPooling("last"), PromptPooling("mean"), PromptPooling("cls")
    assert [last.positions(s, n, 10) for s, n in ((0, 4), (4, 6), (10, 1))] == [
        range(0),
        range(9, 10),
        range(0),
    ]
    assert mean.positions(0, 4, 10) == range(0, 4)
    mean.take(torch.ones(4, 3), range(0, 4), 10)
    assert mean.positions(0, 8, 10) == range(4, 8)  # recomputed after a preemption
    assert cls.positions(0, 4, 10) == range(0, 1) and cls.positions(4, 4, 10) == range(0)
    cls.take(torch.ones(1, 3), range(0, 1), 10)
    assert cls.positions(0, 4, 10) == range(0) and cls.vector() is not None


def write(folder: Path, name: str, value: Any) -> None:
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(value))


ST = "sentence_transformers.models."


def st_modules(*kinds: str) -> list[dict[str, Any]]:
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize"}
    return [
        {"idx": i, "name": str(i), "path": paths.get(k, f"{i}_{k}"), "type": ST + k}
        for i, k in enumerate(kinds)
    ]


def test_pooler_config_from_a_folder(tmp_path: Path) -> None:
    """No sentence-transformers files: the last token, normalized (vLLM's default for a
    generative model); with them, their pooling mode and whether a Normalize module follows;
    a pipeline meshserve does not run is recorded (embeddings refused, the model kept)."""
    write(tmp_path, "config.json", {"hidden_size": 64})
    assert PoolerConfig.from_folder(tmp_path) == PoolerConfig("last", True, 64)
    write(tmp_path, "modules.json", st_modules("Transformer", "Pooling"))
    write(tmp_path, "1_Pooling/config.json", {"pooling_mode_mean_tokens": True})
    assert PoolerConfig.from_folder(tmp_path) == PoolerConfig("mean", False, 64)
    write(tmp_path, "modules.json", st_modules("Transformer", "Pooling", "Normalize"))
    write(tmp_path, "1_Pooling/config.json", {"pooling_mode_lasttoken": True})
    assert PoolerConfig.from_folder(tmp_path) == PoolerConfig("last", True, 64)
    write(tmp_path, "1_Pooling/config.json", {"pooling_mode_max_tokens": True})
    with pytest.raises(PoolingError, match="pooling_mode_max_tokens"):
        PoolerConfig.from_folder(tmp_path).check(None)
    write(tmp_path, "1_Pooling/config.json", {"pooling_mode_cls_token": True})
    write(tmp_path, "modules.json", st_modules("Transformer", "Pooling", "Dense", "Normalize"))
    with pytest.raises(PoolingError, match="Dense"):
        PoolerConfig.from_folder(tmp_path).check(None)
    write(tmp_path, "modules.json", st_modules("Transformer", "Normalize"))
    assert PoolerConfig.from_folder(tmp_path) == PoolerConfig("last", True, 64)  # (no Pooling)
    write(tmp_path, "modules.json", st_modules("Transformer", "Pooling"))
    write(tmp_path, "sentence_bert_config.json", {"max_seq_length": 32})
    assert PoolerConfig.from_folder(tmp_path).max_seq_length == 32
    write(tmp_path, "config.json", {"hidden_size": 64, "matryoshka_dimensions": "all"})
    with pytest.raises(PoolingError, match="matryoshka_dimensions is malformed"):
        PoolerConfig.from_folder(tmp_path).check(None)
    write(tmp_path, "config.json", {"hidden_size": 64})
    (tmp_path / "modules.json").write_text("{not json")
    with pytest.raises(PoolingError, match="modules.json"):
        PoolerConfig.from_folder(tmp_path).check(None)


def test_dimensions_follow_vllms_matryoshka_rules(tmp_path: Path) -> None:
    write(tmp_path, "config.json", {"hidden_size": 64})
    plain = PoolerConfig.from_folder(tmp_path)
    plain.check(None)
    plain.check(64)  # (the model's own size changes nothing)
    with pytest.raises(PoolingError, match="does not support Matryoshka"):
        plain.check(32)
    write(tmp_path, "config.json", {"hidden_size": 64, "is_matryoshka": True})
    PoolerConfig.from_folder(tmp_path).check(8)
    with pytest.raises(PoolingError, match=r"within 1\.\.64"):
        PoolerConfig.from_folder(tmp_path).check(65)
    write(tmp_path, "config.json", {"hidden_size": 64, "matryoshka_dimensions": [16, 32]})
    PoolerConfig.from_folder(tmp_path).check(32)
    with pytest.raises(PoolingError, match="only these 'dimensions': 16, 32"):
        PoolerConfig.from_folder(tmp_path).check(8)
