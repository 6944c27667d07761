"""common/tokenizer.py: encode/decode, chat templates (transformers is the oracle), and the
incremental detokenizer on text whose characters are split across tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from common.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny corpus for a tiny tokenizer.",
    "def main():\n    return 42\n",
    "你好，世界！今天天气很好。",
    "日本語の文章も少しあります。",
    "Emoji: 😀 🎉 👍",
    "Numbers 12345 and symbols @#$%^&*()",
]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Whitespace-heavy on purpose: trim_blocks / lstrip_blocks decide what survives.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
    {% set ns.count = ns.count + 1 %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
    {% if loop.index > 20 %}{% break %}{% endif %}
{% endfor %}
{% if tools %}
<|im_start|>tools
{{ tools | tojson }}<|im_end|>
{% endif %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
{{- '' if ns.count else eos_token -}}
"""

# Characters that the tiny vocabularies cannot hold whole: they come out as byte tokens.
DETOK_TEXTS = [
    "你好，世界！这是一个测试：增量解码不能输出半个字符。",
    "Emoji 😀🎉👍🏽, a family 👨‍👩‍👧‍👦 and a flag 🇯🇵!",
    "mixed 中文 and English — ünïcødé ✓ 測試 ∑∫",
    "日本語のテキストと한국어 텍스트",
]


def train_byte_level_bpe(vocab_size: int = 400) -> Backend:
    """A GPT-2 style byte-level BPE trained on CORPUS (special tokens get ids 0..2)."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


def bpe_vocab_and_merges(tok: Backend) -> tuple[list[str], list[tuple[str, str]]]:
    """Tokens in id order and merges of a trained BPE tokenizer."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = json.loads(tok.to_str())["model"]["merges"]
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
    return tokens, [(a, b) for a, b in pairs]


def train_sentencepiece_like() -> Backend:
    """A Llama-2 style tokenizer: metaspace normalizer, byte fallback, decoder that strips the
    leading space (so decoding a window from the middle of a stream differs from the stream)."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    base = Backend(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
        limit_alphabet=60,
        show_progress=False,
    )
    base.train_from_iterator([line for line in CORPUS if line.isascii()] * 3, trainer)
    raw = json.loads(base.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in raw["merges"]]
    tok = Backend(
        models.BPE(
            vocab=raw["vocab"],
            merges=[(a, b) for a, b in merges],
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    tok.normalizer = base.normalizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def write_tokenizer_folder(
    folder: Path,
    backend: Backend,
    *,
    chat_template: str | None = CHATML,
    bos: str = "<|im_start|>",
    eos: str = "<|im_end|>",
    **extra: Any,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "clean_up_tokenization_spaces": False,
        **extra,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_folder(tmp_path_factory.mktemp("bl"), train_byte_level_bpe())


@pytest.fixture(scope="module")
def spm_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_folder(
        tmp_path_factory.mktemp("spm"), train_sentencepiece_like(), bos="<s>", eos="</s>"
    )


def hf_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


# ---------------------------------------------------------------- encode / decode


ENCODE_TEXTS = [
    "Hello world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "你好，世界 😀 ünïcødé",
    "",
]


@pytest.mark.parametrize("text", ENCODE_TEXTS)
def test_encode_decode_match_transformers(byte_level: Path, text: str) -> None:
    ours = Tokenizer.from_folder(byte_level)
    ref = hf_tokenizer(byte_level)
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)


def test_special_tokens_and_vocab(byte_level: Path) -> None:
    tok = Tokenizer.from_folder(byte_level)
    assert tok.vocab_size == train_byte_level_bpe().get_vocab_size()
    assert tok.bos_token == "<|im_start|>" and tok.bos_token_id == 1
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == (2,)
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, *tok.encode("hi"), 2]) == "hi"


def test_eos_ids_from_generation_config(tmp_path: Path) -> None:
    folder = write_tokenizer_folder(tmp_path, train_byte_level_bpe())
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert Tokenizer.from_folder(folder).eos_token_ids == (0, 2)


def test_token_dict_spelling_and_jinja_file(tmp_path: Path) -> None:
    """Older configs spell special tokens as AddedToken dicts; newer save chat_template.jinja."""
    folder = write_tokenizer_folder(
        tmp_path,
        train_byte_level_bpe(),
        chat_template=None,
        eos={"content": "<|endoftext|>", "special": True},  # type: ignore[arg-type]
    )
    (folder / "chat_template.jinja").write_text(CHATML)
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_ids == (0,)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]).endswith("assistant\n")


def test_missing_or_broken_folder(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot be loaded"):
        Tokenizer.from_folder(tmp_path)


# ---------------------------------------------------------------- chat templates

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "什么是 GGUF？"},
        {"role": "assistant", "content": "A file format 😀"},
        {"role": "user", "content": 'Say "ok"'},
    ],
]


@pytest.mark.parametrize("template", [CHATML, RICH_TEMPLATE], ids=["chatml", "rich"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one", "four"])
def test_chat_template_matches_transformers(
    tmp_path: Path, template: str, add_generation_prompt: bool, conversation: list[dict[str, Any]]
) -> None:
    folder = write_tokenizer_folder(tmp_path, train_byte_level_bpe(300), chat_template=template)
    ours = Tokenizer.from_folder(folder)
    ref = hf_tokenizer(folder)
    tools = [{"type": "function", "function": {"name": "höhe", "parameters": {}}}]
    for kwargs in ({}, {"tools": tools}):
        expected = ref.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        got = ours.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, **kwargs
        )
        assert got == expected


def test_encode_user_turn_matches_transformers(tmp_path: Path) -> None:
    """One user turn, templated and encoded as transformers' apply_chat_template(tokenize=True)
    does it (the template's special tokens, nothing added on top)."""
    folder = write_tokenizer_folder(tmp_path, train_byte_level_bpe(300))
    ours = Tokenizer.from_folder(folder)
    ref = hf_tokenizer(folder)
    messages = [{"role": "user", "content": "héllo, wörld?"}]
    expected = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected, list):  # transformers >= 5 returns a BatchEncoding
        expected = expected["input_ids"]
    assert ours.encode_user_turn("héllo, wörld?") == list(expected)


def test_chat_template_errors(tmp_path: Path) -> None:
    folder = write_tokenizer_folder(
        tmp_path, train_byte_level_bpe(300), chat_template=RICH_TEMPLATE
    )
    tok = Tokenizer.from_folder(folder)
    with pytest.raises(TokenizerError, match="unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(TokenizerError, match="must be objects"):
        tok.apply_chat_template(["hello"])  # type: ignore[list-item]
    # the sandbox refuses attribute tricks
    evil = write_tokenizer_folder(
        tmp_path / "evil",
        train_byte_level_bpe(300),
        chat_template="{{ messages.__class__.__mro__ }}",
    )
    with pytest.raises(Exception, match="unsafe|access|attribute"):
        Tokenizer.from_folder(evil).apply_chat_template([{"role": "user", "content": "x"}])
    bare = write_tokenizer_folder(tmp_path / "bare", train_byte_level_bpe(300), chat_template=None)
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_folder(bare).apply_chat_template([{"role": "user", "content": "x"}])
    broken = write_tokenizer_folder(
        tmp_path / "broken", train_byte_level_bpe(300), chat_template="{% for %}"
    )
    with pytest.raises(TokenizerError, match="does not compile"):
        Tokenizer.from_folder(broken).apply_chat_template([{"role": "user", "content": "x"}])


def test_generation_tag_renders_its_body(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}"
    )
    folder = write_tokenizer_folder(tmp_path, train_byte_level_bpe(300), chat_template=template)
    rendered = Tokenizer.from_folder(folder).apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    )
    assert rendered == "[a][b]"


# ---------------------------------------------------------------- incremental detokenizer


def _stream(
    tok: Tokenizer, ids: list[int], chunks: list[int], **kwargs: Any
) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas: list[str] = []
    pos = 0
    for size in chunks:
        deltas.append(detok.add(ids[pos : pos + size]))
        pos += size
    assert pos == len(ids)
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    return "".join(deltas), deltas


@pytest.mark.parametrize("which", ["byte_level", "spm_like"])
@pytest.mark.parametrize("text", DETOK_TEXTS)
def test_detokenizer_one_token_at_a_time(
    request: pytest.FixtureRequest, which: str, text: str
) -> None:
    tok = Tokenizer.from_folder(request.getfixturevalue(which))
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # the test only means something if some tokens hold part of a character
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    out, deltas = _stream(tok, ids, [1] * len(ids))
    assert out == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # nothing was left for finish()


@pytest.mark.parametrize("which", ["byte_level", "spm_like"])
def test_detokenizer_random_chunks_and_prompt(request: pytest.FixtureRequest, which: str) -> None:
    tok = Tokenizer.from_folder(request.getfixturevalue(which))
    rng = random.Random(0)
    prompt_text = "Hello world! 你好"
    for text in DETOK_TEXTS:
        full = tok.encode(prompt_text + " " + text, add_special_tokens=False)
        prompt = tok.encode(prompt_text, add_special_tokens=False)
        assert full[: len(prompt)] == prompt
        generated = full[len(prompt) :]
        chunks: list[int] = []
        while sum(chunks) < len(generated):
            chunks.append(min(rng.randint(1, 4), len(generated) - sum(chunks)))
        out, deltas = _stream(tok, generated, chunks, prompt_ids=prompt)
        # with the prompt as context the leading space survives even when the decoder strips it
        assert out == tok.decode(full)[len(tok.decode(prompt)) :]
        assert out.endswith(text)
        assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_skips_special_tokens(byte_level: Path) -> None:
    tok = Tokenizer.from_folder(byte_level)
    ids = [*tok.encode("你好"), 2, *tok.encode(" 😀"), 0]
    assert _stream(tok, ids, [1] * len(ids))[0] == "你好 😀"
    kept, _ = _stream(tok, ids, [1] * len(ids), skip_special_tokens=False)
    assert kept == "你好<|im_end|> 😀<|endoftext|>"


def test_detokenizer_flushes_an_unfinished_character(byte_level: Path) -> None:
    tok = Tokenizer.from_folder(byte_level)
    ids = tok.encode("ab😀", add_special_tokens=False)
    cut = next(i for i in range(len(ids)) if "\ufffd" in tok.decode(ids[: i + 1]))
    detok = tok.detokenizer()
    deltas = [detok.add([i]) for i in ids[: cut + 1]]
    assert "".join(deltas) == "ab"
    assert detok.finish() == "\ufffd"  # the stream ended mid-character: say so, once
    assert detok.add([]) == ""


def test_a_prompt_ending_in_byte_fallback_characters_leaves_the_generated_ones_whole(
    spm_like: Path,
) -> None:
    """The 5-id context taken from the prompt started mid-character ("好" is 3 byte tokens):
    SentencePiece's byte fallback turned the whole run of bytes, the generated "世界" joined
    to it, into U+FFFD, and the stream said nothing until a line of U+FFFD at its end."""
    tok = Tokenizer.from_folder(spm_like)
    prompt = tok.encode("Translate: 你好", add_special_tokens=False)
    full = tok.encode("Translate: 你好世界。", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    assert tok.decode(prompt[-IncrementalDetokenizer.CONTEXT_TOKENS :]).startswith("\ufffd")
    generated = full[len(prompt) :]
    out, deltas = _stream(tok, generated, [1] * len(generated), prompt_ids=prompt)
    assert out == "世界。" and not any("\ufffd" in d for d in deltas)


def test_the_space_after_a_skipped_special_token_survives_one_token_steps(
    spm_like: Path,
) -> None:
    """The context kept after a step was that step's ids alone: a skipped </s> decodes to
    nothing, and SentencePiece's decoder then stripped the next token's leading space."""
    tok = Tokenizer.from_folder(spm_like)
    prompt = tok.encode("The quick brown fox", add_special_tokens=False)
    eos = tok.token_to_id("</s>")
    assert eos is not None
    ids = [*tok.encode("jumps", add_special_tokens=False), eos]
    ids += tok.encode("over", add_special_tokens=False)
    whole = tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert whole == " jumps over"
    for chunks in ([1] * len(ids), [len(ids)], [2, 2, 3]):
        assert _stream(tok, ids, chunks, prompt_ids=prompt)[0] == whole, chunks
    # A long run of them (ignore_eos: EOS after EOS) keeps the context bounded: walking back
    # to the last id with text made it grow by one id a step, each step slower (O(n^2)).
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    run = [*ids[:-2], *[eos] * 1000, *ids[-2:]]
    assert "".join(detok.add([t]) for t in run) + detok.finish() == whole
    assert len(detok._ids) <= 4


def test_the_chat_template_is_the_one_transformers_picks(tmp_path: Path) -> None:
    """Named templates: "tool_use" renders a request with tools (Hermes-2-Pro, Command-R ship
    one), where the default was used and the tools left out; a chat_template.jinja file wins
    over tokenizer_config.json's entry, as in transformers."""
    plain = "PLAIN{% for m in messages %} {{ m['content'] }}{% endfor %}"
    tool_use = "TOOLS {{ tools | length }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
    named = [{"name": "default", "template": plain}, {"name": "tool_use", "template": tool_use}]
    folder = write_tokenizer_folder(tmp_path / "named", train_byte_level_bpe(300))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": named}))
    ours, ref = Tokenizer.from_folder(folder), hf_tokenizer(folder)
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for given in (None, tools):
        expected = ref.apply_chat_template(messages, tokenize=False, tools=given)
        assert ours.apply_chat_template(messages, tools=given) == expected
    assert ours.apply_chat_template(messages, tools=tools) == "TOOLS 1 hi"
    assert ours.chat_template_text(tools=True) == tool_use and ours.chat_template == plain

    (folder / "chat_template.jinja").write_text(
        "FILE{% for m in messages %} {{ m['content'] }}{% endfor %}"
    )
    ours, ref = Tokenizer.from_folder(folder), hf_tokenizer(folder)
    expected = ref.apply_chat_template(messages, tokenize=False)
    assert ours.apply_chat_template(messages) == expected == "FILE hi"


def test_bad_words_encode_as_vllm_encodes_them(byte_level: Path) -> None:
    """Each bad word as a text's start, and with a leading space where that gives another
    first token in as many tokens (vLLM's rule); more than 1,024 tokens in all is a 400."""
    from common.runtime import RequestError
    from services.tokenizer.service import bad_words_token_ids

    tok = Tokenizer.from_folder(byte_level)

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    assert len(enc(" fox")) != len(enc("fox"))  # the spaced form is not kept for "fox"
    assert len(enc(" world")) == len(enc("world")) and enc(" world")[0] != enc("world")[0]
    assert bad_words_token_ids(tok, ["fox", " world"]) == [enc("fox"), enc("world"), enc(" world")]
    with pytest.raises(RequestError, match="1024 tokens") as info:
        bad_words_token_ids(tok, ["quick brown fox jumps over the lazy dog " * 20] * 3)
    assert info.value.param == "bad_words"


def test_truncating_a_text_prompt_keeps_its_bos_as_vllm_does() -> None:
    """truncate_prompt_tokens on a text prompt whose encoding adds a BOS: the BOS and the last
    N - 1 tokens (transformers' left truncation, vLLM's); token prompts and chat: the last N."""
    from types import SimpleNamespace

    from common.wire.tokenizer import GenerateRequest, WireSamplingParams
    from services.tokenizer.service import TokenizerService

    class WithBos:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            ids = [10 + ord(c) - ord("a") for c in text]
            return [1, *ids] if add_special_tokens else ids

    service = SimpleNamespace(tokenizer=WithBos())
    text = GenerateRequest("r", "i", WireSamplingParams(), prompt="abcdef")
    ids = WithBos().encode("abcdef")  # [1, 10, 11, 12, 13, 14, 15]
    assert TokenizerService.truncated(service, text, ids, 3) == [1, 14, 15]  # type: ignore[arg-type]
    assert TokenizerService.truncated(service, text, ids, 1) == [1]  # type: ignore[arg-type]
    assert TokenizerService.truncated(service, text, ids, 9) == ids  # type: ignore[arg-type]
    by_ids = GenerateRequest("r", "i", WireSamplingParams(), prompt_token_ids=ids)
    assert TokenizerService.truncated(service, by_ids, ids, 3) == [13, 14, 15]  # type: ignore[arg-type]
