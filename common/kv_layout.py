"""Where a paged KV pool's pages lie in memory, and which byte ranges move a sequence's pages
from one pool to another (torch-free: the NIXL transport and the wire use it).

A pool is one contiguous buffer per layer (``gpu/kv_cache.py``): page ``p`` of layer ``l``
starts at ``layer_bases[l] + p * page_bytes`` and is ``page_bytes`` long (keys and values of
``page_size`` tokens). Those buffers are what is registered with NIXL once at start; the
transport also prepares, once per pool, one descriptor per page of every layer
(``page_extents``), and a transfer then names pages by their index in that list
(``descriptor_indices``).
"""

from __future__ import annotations

from dataclasses import dataclass

Extent = tuple[int, int]  # (address, length in bytes)


@dataclass(frozen=True)
class KVLayout:
    layer_bases: tuple[int, ...]
    page_bytes: int
    num_pages: int

    def __post_init__(self) -> None:
        if not self.layer_bases or self.page_bytes < 1 or self.num_pages < 1:
            raise ValueError("a KV layout needs layers, page_bytes >= 1 and num_pages >= 1")

    @property
    def regions(self) -> list[Extent]:
        """One extent per layer: the whole pool, as registered with the transport."""
        return [(base, self.page_bytes * self.num_pages) for base in self.layer_bases]

    @property
    def page_extents(self) -> list[Extent]:
        """Every page of every layer, layer by layer: entry ``l * num_pages + p`` is page ``p``
        of layer ``l``."""
        size = self.page_bytes
        return [(base + p * size, size) for base in self.layer_bases for p in range(self.num_pages)]

    def descriptor_indices(self, pages: list[int]) -> list[int]:
        """Where ``pages`` (of every layer, layer by layer) are in ``page_extents``."""
        self.check_pages(pages)
        return [layer * self.num_pages + p for layer in range(len(self.layer_bases)) for p in pages]

    def compatible(self, other: KVLayout) -> bool:
        """Can pages be copied between the two pools byte for byte?"""
        return len(self.layer_bases) == len(other.layer_bases) and (
            self.page_bytes == other.page_bytes
        )

    def check_pages(self, pages: list[int]) -> None:
        bad = [p for p in pages if not 0 <= p < self.num_pages]
        if bad:
            raise ValueError(f"pages {bad[:4]} are outside this pool of {self.num_pages}")


def paired_extents(
    src: KVLayout, src_pages: list[int], dst: KVLayout, dst_pages: list[int]
) -> tuple[list[Extent], list[Extent]]:
    """The source and destination extents that copy ``src_pages[i]`` to ``dst_pages[i]`` in
    every layer. Runs of pages consecutive on both sides become one extent (pages come off the
    free lists mostly in order), so a transfer is a few large copies, not one per page."""
    runs = paired_runs(src, src_pages, dst, dst_pages)
    size = src.page_bytes
    src_ext = [(b + s * size, n * size) for b in src.layer_bases for s, _, n in runs]
    dst_ext = [(b + d * size, n * size) for b in dst.layer_bases for _, d, n in runs]
    return src_ext, dst_ext


def paired_runs(
    src: KVLayout, src_pages: list[int], dst: KVLayout, dst_pages: list[int]
) -> list[tuple[int, int, int]]:
    """(first source page, first destination page, pages) of each run of pages consecutive on
    both sides, after checking that the pages can be copied at all."""
    if not src.compatible(dst):
        raise ValueError("the two KV pools differ in layers or page size")
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destinations")
    src.check_pages(src_pages)
    dst.check_pages(dst_pages)
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
