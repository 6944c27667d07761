"""Facts every stage of the mesh must agree on, decided by one rule that the scheduler (whom to
route to) and the gateway (what ``/health`` says) both apply.

The KV page size: the tokenizer hashes each prompt's full pages with its ``--page-size``
(``TokenizedRequest.page_hashes``); an executor's prefix cache and the prefix index key pages
by the executor's own page size. An executor paging differently still answers correctly (its
engine hashes pages itself) but never matches a routed prefix, so cache-aware routing loses
every hit there without a word. Such an executor is refused work, loudly, instead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping


def mesh_page_size(
    tokenizer_sizes: Iterable[int], executor_sizes: Mapping[str, int]
) -> tuple[int | None, str]:
    """The page size the mesh runs at, and whose it is (for error messages).

    The tokenizers' when any announced one: the page hashes of every request come from
    them. Else the one most executors use (a tie goes to the executor listed first, i.e. seen
    first). ``None`` when nobody has said.
    """
    by_tokenizers = Counter(tokenizer_sizes).most_common(1)
    if by_tokenizers:
        return by_tokenizers[0][0], "the tokenizer's"
    by_executors = Counter(executor_sizes.values()).most_common(1)
    if by_executors:
        return by_executors[0][0], "the other executors'"
    return None, ""


def page_size_refusals(
    tokenizer_sizes: Iterable[int], executor_sizes: Mapping[str, int]
) -> dict[str, str]:
    """Executors whose page size is not the mesh's, each with the reason it gets no work."""
    tokenizers = list(tokenizer_sizes)
    size, whose = mesh_page_size(tokenizers, executor_sizes)
    refused = {
        executor: (
            f"executor {executor} has page_size {own}, but {whose} is {size}: prompt page "
            "hashes would never match its cache"
        )
        for executor, own in executor_sizes.items()
        if size is not None and own != size
    }
    if len(set(tokenizers)) > 1:  # the mesh has no single page size: say so with the rest
        for executor in refused:
            refused[executor] += f" (tokenizers disagree: {sorted(set(tokenizers))})"
    return refused
