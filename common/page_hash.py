"""Chained hashes of full KV pages: the key of the prefix cache in executors and the index.

Page i's hash covers page i's tokens and (through the chain) every token before it, so equal
hashes mean equal prefixes. 64-bit blake2b: stable across processes and machines (Python's
``hash`` is salted per process), and cheap enough to run in the tokenizer per request.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0


def namespace_root(namespace: str) -> int:
    """The chain's seed for pages computed under ``namespace`` (a LoRA adapter's name: its
    KV differs from the base model's for the same tokens); ``ROOT_HASH`` for none. Only the
    hashes differ: the first page's parent is still reported as ``ROOT_HASH``, so the prefix
    index keeps one tree, its first level holding each namespace's first pages."""
    if not namespace:
        return ROOT_HASH
    h = hashlib.blake2b(namespace.encode(), digest_size=8, person=b"meshserve-ns")
    return int.from_bytes(h.digest(), "little") or 1


def page_hash(parent: int, tokens: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")


def page_hashes(tokens: Sequence[int], page_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of every *full* page of ``tokens`` (a trailing partial page has none);
    ``parent``: the chain's seed (``namespace_root``)."""
    hashes = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = page_hash(parent, tokens[start : start + page_size])
        hashes.append(parent)
    return hashes
