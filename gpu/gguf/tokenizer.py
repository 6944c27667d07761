"""A Hugging Face ``tokenizers.Tokenizer`` rebuilt from a GGUF vocabulary: byte-level BPE
(``tokenizer.ggml.model`` ``gpt2``: Llama 3, Qwen, SmolLM) here, SentencePiece (``llama``:
Llama 2, Mistral, Mixtral) by transformers' own GGUF tokenizer conversion (what vLLM serves
such a file with)."""

from __future__ import annotations

import logging
from typing import Any

from gpu.config import ModelError
from gpu.gguf.hf_config import token_id
from gpu.gguf.reader import Gguf

logger = logging.getLogger(__name__)

# Pre-tokenizer split patterns (tokenizer.ggml.pre) for byte-level BPE vocabularies.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PATTERNS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Vocabularies whose original tokenizer.json sets BPE ignore_merges (whole-word lookups first).
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"}
# GPT-2's own regex (ByteLevel use_regex=True), optionally preceded by single-digit splitting.
_GPT2_STYLE = {"default", "gpt2", "gpt-2", "smollm", "starcoder", "refact"}
_DIGIT_SPLIT = {"smollm", "starcoder", "refact"}
# Vocabularies whose Hugging Face tokenizer.json normalizes to NFC first.
_NFC_NORMALIZED = {"qwen2", "deepseek-r1-qwen"}

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_level_pre_tokenizer(pre: str) -> tuple[Any, bool]:
    from tokenizers import Regex, pre_tokenizers

    if pre in _SPLIT_PATTERNS:
        split = pre_tokenizers.Split(Regex(_SPLIT_PATTERNS[pre]), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, byte_level]), pre in _IGNORE_MERGES
    if pre not in _GPT2_STYLE:
        logger.warning(
            "GGUF pre-tokenizer %r is not known to meshserve; using GPT-2's split pattern", pre
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT:
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level]), False
    return byte_level, False


def build_tokenizer(g: Gguf) -> tuple[Any, dict[str, Any]]:
    """``(tokenizers.Tokenizer, tokenizer_config dict)`` for the file's vocabulary."""
    from tokenizers import processors

    model_kind = g.get("tokenizer.ggml.model")
    tokens: list[str] = list(g.require("tokenizer.ggml.tokens"))
    if model_kind == "gpt2":
        tok = _byte_level_tokenizer(g, tokens)
        post: list[Any] = [processors.ByteLevel(trim_offsets=False)]
        add_bos_default = False
    elif model_kind == "llama":
        tok = _sentencepiece_tokenizer(g)
        post, add_bos_default = [], True  # (llama.cpp adds BOS unless the file says not)
    else:
        raise ModelError(
            f"{g.path}: tokenizer model {model_kind!r} is not supported (byte-level BPE, "
            "'gpt2', and SentencePiece, 'llama', are)"
        )
    return tok, _finish(g, tok, tokens, post, add_bos_default)


def _sentencepiece_tokenizer(g: Gguf) -> Any:
    """transformers' conversion of a SentencePiece GGUF vocabulary (BPE over the scores'
    merges, byte fallback, the ``▁`` space)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )

        architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(g.path))
        tok, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except (ImportError, KeyError, ValueError) as exc:
        raise ModelError(f"{g.path}: cannot convert its SentencePiece vocabulary: {exc}") from exc
    return tok


def _byte_level_tokenizer(g: Gguf, tokens: list[str]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    merges_raw: list[str] = list(g.require("tokenizer.ggml.merges"))
    types: list[int] = [int(t) for t in g.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
    pre = str(g.get("tokenizer.ggml.pre") or "default")

    alphabet = set(_bytes_to_unicode().values())
    spelling = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    added: list[Any] = []
    for index, (token, kind) in enumerate(zip(tokens, types, strict=False)):
        special = kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
        if not special and not set(token) <= alphabet:
            # a normal token written as raw text: spell it in the byte alphabet like the rest
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        if token in vocab:
            logger.warning(
                "GGUF vocabulary repeats token %r (id %d); keeping the first", token, index
            )
            continue
        vocab[token] = index
        if special:
            added.append(AddedToken(token, special=kind == _TOKEN_TYPE_CONTROL, normalized=False))
    merges: list[tuple[str, str]] = []
    for merge in merges_raw:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelError(f"{g.path}: malformed BPE merge {merge!r}")
        merges.append((left, right))

    pre_tokenizer, ignore_merges = _byte_level_pre_tokenizer(pre)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=ignore_merges,
        )
    )
    if pre in _NFC_NORMALIZED:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    control = [t for t in added if t.special]
    if control:
        tok.add_special_tokens(control)
    user_defined = [t for t in added if not t.special]
    if user_defined:
        tok.add_tokens(user_defined)
    return tok


def _finish(
    g: Gguf, tok: Any, tokens: list[str], post: list[Any], add_bos_default: bool
) -> dict[str, Any]:
    """The BOS / EOS the file asks to add (on ``tok``'s post-processor, after ``post``) and
    the tokenizer_config: special tokens, the chat templates."""
    from tokenizers import processors

    def token_str(tid: int | None) -> str | None:
        return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None

    bos_id, eos_id = token_id(g, "bos"), token_id(g, "eos")
    bos, eos = token_str(bos_id), token_str(eos_id)
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(g.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    head: list[str] = []
    tail: list[str] = []
    template_tokens: dict[str, int] = {}
    if add_bos and bos is not None and bos_id is not None:
        head, template_tokens[bos] = [bos], bos_id
    if add_eos and eos is not None and eos_id is not None:
        tail, template_tokens[eos] = [eos], eos_id
    if template_tokens:
        post.append(
            processors.TemplateProcessing(
                single=" ".join([*head, "$A", *tail]),
                pair=" ".join([*head, "$A", "$B", *tail]),
                special_tokens=list(template_tokens.items()),
            )
        )
    if post:
        tok.post_processor = processors.Sequence(post)

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_str(token_id(g, "unknown")),
        "pad_token": token_str(token_id(g, "padding")),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(g.get(f"{g.require('general.architecture')}.context_length", 2048)),
    }
    # the default template, and named ones (llama.cpp's tokenizer.chat_template.<name>, such
    # as tool_use) in the list form transformers reads
    prefix = "tokenizer.chat_template."
    named = {
        k.removeprefix(prefix): str(v) for k, v in g.meta.items() if k.startswith(prefix) and v
    }
    template = g.get("tokenizer.chat_template")
    if named:
        named = ({"default": str(template)} if template else {}) | named
        tok_config["chat_template"] = [{"name": k, "template": v} for k, v in named.items()]
    elif template:
        tok_config["chat_template"] = str(template)
    return tok_config
