"""The raw bytes of each token, for logprobs' ``bytes`` (OpenAI's: the token's own UTF-8
bytes, so a client can join the tokens of a character cut in two). Decoding a token alone
cannot give them: half an emoji decodes to U+FFFD, whose bytes are not the token's.

Each ``tokenizers`` decoder spells bytes its own way in the vocabulary:

- ``ByteLevel`` (GPT-2, Llama 3, Qwen, SmolLM): every byte is one printable character of a
  fixed 256-character alphabet (``Ġ`` is the space byte, 0x20).
- ``ByteFallback`` (SentencePiece models such as Llama 2 and Mistral): a byte the vocabulary
  lacks is a token ``<0xF0>``; other tokens are text with ``▁`` for a space.

Added tokens (``<|im_end|>``) are their text. Any other decoder: the token decoded alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """The ``ByteLevel`` pre-tokenizer's character for each byte, inverted: printable Latin-1
    bytes stand for themselves, the others (control bytes, space, ...) for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shifted
            shifted += 1
    return {chr(c): b for b, c in chars.items()}


def decoder_kind(backend: Any) -> str:
    """``byte_level``, ``byte_fallback`` or ``other``, from the tokenizer's decoder."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds:
        return "byte_fallback"
    return "other"


class TokenBytes:
    """``token_bytes(id)`` for one ``tokenizers.Tokenizer``, each id worked out once."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.kind = decoder_kind(backend)
        self.alphabet = byte_level_alphabet()
        added = backend.get_added_tokens_decoder().items()
        self.added: dict[int, str] = {int(i): str(t.content) for i, t in added}
        self.known: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self.known.get(token_id)
        if found is None:
            found = self.known[token_id] = self.work_out(token_id)
        return found

    def work_out(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        found = self.backend.id_to_token(token_id)
        if found is None:  # past the vocabulary (a padded LM head)
            return b""
        token = str(found)
        if self.kind == "byte_level" and all(c in self.alphabet for c in token):
            return bytes(self.alphabet[c] for c in token)
        if self.kind == "byte_fallback":
            byte = _BYTE_TOKEN.fullmatch(token)
            return bytes([int(byte.group(1), 16)]) if byte else token.replace("▁", " ").encode()
        return str(self.backend.decode([token_id], skip_special_tokens=False)).encode()
