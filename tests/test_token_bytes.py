"""Logprobs' ``bytes`` are each token's own: joined, the tokens of a text give its UTF-8
bytes, a character cut between two tokens included (decoding a token alone gives U+FFFD)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models

from common.config import MeshConfig
from common.token_bytes import TokenBytes, byte_level_alphabet
from common.tokenizer import Tokenizer
from common.wire.detokenizer import WireTokenLogprob
from common.wire.gateway import TextLogprob
from services.detokenizer.service import DetokenizerConfig, DetokenizerService
from services.gateway.responses import chat_logprobs

TEXT = "Hi 🙂 über 数据\n\tend"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama31"])
def test_the_tokens_of_a_text_join_into_its_bytes(tiny_models: dict[str, Path], kind: str):
    tok = Tokenizer.from_folder(tiny_models[kind])
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == TEXT.encode()
    # Some token holds part of a character (the tiny vocabularies split most of these).
    assert any(tok.decode([i]) == "\ufffd" for i in ids)
    eos = tok.eos_token_ids[0]  # an added token: its text
    assert tok.token_bytes(eos) == tok.decode([eos], skip_special_tokens=False).encode()


def test_the_byte_level_alphabet_is_a_bijection_onto_the_bytes():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == 0x20 and alphabet["Ċ"] == 0x0A and alphabet["A"] == 0x41


def test_byte_fallback_tokens_are_their_byte_and_pieces_their_text():
    """SentencePiece-style (Llama 2, Mistral): ``<0xF0>`` is one byte, ``▁`` a space."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"▁hi": 256, "x": 257}
    backend = Backend(models.BPE(vocab, [], byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    token_bytes = TokenBytes(backend)
    assert token_bytes.kind == "byte_fallback"
    assert token_bytes(0xF0) == b"\xf0" and token_bytes(256) == b" hi"
    assert token_bytes(257) == b"x" and token_bytes(10_000) == b""


def test_logprobs_carry_each_token_and_alternatives_own_bytes(tiny_llama: Path):
    svc = DetokenizerService(DetokenizerConfig(MeshConfig(), str(tiny_llama)))
    tok = svc.tokenizer
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the emoji is cut between tokens
    entries = svc.logprobs([WireTokenLogprob(i, -0.5, [(j, -1.0) for j in ids]) for i in ids])
    assert entries is not None
    content = chat_logprobs(entries)["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == "🙂".encode()
    for c in content:
        assert [bytes(t["bytes"]) for t in c["top_logprobs"]] == [tok.token_bytes(j) for j in ids]
    # A sender without the alternatives' bytes: their text's.
    old = TextLogprob("a", -0.1, [97], [("b", -0.2)])
    assert chat_logprobs([old])["content"][0]["top_logprobs"][0]["bytes"] == [98]
