"""Host tensors on transparent huge pages, for the KV pool on the CPU.

A CPU pool is a few hundred MB that every decode step reads and that disaggregation copies to
another process (NIXL over CMA: the kernel pins and copies the pages one by one). On 4 KiB
pages both pay per page: TLB misses in attention and a page-table walk per page in the copy.
This host's kernel gives huge pages only where asked (``transparent_hugepage=madvise``), so a
pool is mapped here itself, aligned to 2 MiB and advised before it is first touched.
On a kernel without THP the advice is refused and the pool is ordinary memory.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

HUGE_PAGE = 2 << 20  # x86-64 and arm64 with 4 KiB base pages


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``shape`` whose memory the kernel is asked to back with huge
    pages; the tensor keeps its mapping alive."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = elem
    for n in shape:
        nbytes *= n
    # One spare huge page so the tensor can start on a 2 MiB boundary.
    # Private: Python's default anonymous map is shared memory, which this kernel never backs
    # with huge pages (shmem_enabled=never).
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    mapped = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)
    raw = torch.frombuffer(mapped, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    # No THP on this kernel or platform: plain pages.
    with contextlib.suppress(AttributeError, OSError):
        mapped.madvise(mmap.MADV_HUGEPAGE, offset, len(mapped) - offset)
    tensor = raw[offset : offset + nbytes].view(dtype).view(shape)
    # Touched now, after the advice, so the faults take huge pages; and a pool is resident
    # from the start (what --kv-cache-tokens asked for), with no fault inside a step later.
    tensor.zero_()
    return tensor


def huge_pages_backing(tensors: list[torch.Tensor]) -> int:
    """Bytes the kernel backs with huge pages now in the mappings that hold ``tensors``, each
    mapping counted once (from /proc/self/smaps; 0 where it is not readable). A mapping may
    also hold memory next to them: neighbours with the same flags are merged into one."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
    total = 0
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = any(lo < end and hi > start for start, end in spans)
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total
