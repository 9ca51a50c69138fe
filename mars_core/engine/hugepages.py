"""Weights the native kernels stream, gathered into one buffer on 2 MB pages (Linux transparent huge pages).

A one-position w8a8 forward reads every weight once, so it is bound by how fast one core can stream them. On 4 KB
pages that stream crosses a page every 4 KB: each crossing costs a TLB walk, and the hardware prefetchers stop at
page boundaries. On 2 MB pages neither happens (docs/experiments/cpu-speed-issue-27.md, "The AVX2 kernel reads
its weights as one stream"). Where the kernel's setting is `madvise` (the usual default), memory goes onto huge pages
only where a program asks with madvise(MADV_HUGEPAGE) before first touching it; where it is `always` this changes
nothing, and where it is `never` (or off Linux) the weights stay on ordinary pages. The values are copied, never
changed, so no result changes. MARS_HUGE_PAGES=0 leaves the weights where torch put them.
"""
from __future__ import annotations

import ctypes
import os
import sys

import torch

HUGE = 2 << 20          # x86-64's transparent huge page
MADV_HUGEPAGE = 14      # <sys/mman.h>
ALIGN = 64              # each tensor starts on a cache line, as torch's allocator places it


def _advise(addr: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) on [addr, addr + length); False where that is refused or not Linux."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(MADV_HUGEPAGE)) == 0
    except (OSError, AttributeError):
        return False


def gather(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """Copies of `tensors` (contiguous CPU tensors) as views into one new buffer whose 2 MB-aligned part was advised
    onto huge pages before it was written, and whether the advice was taken. The buffer lives as long as a view."""
    if os.environ.get("MARS_HUGE_PAGES", "1") == "0":
        return list(tensors), False
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += (n + ALIGN - 1) // ALIGN * ALIGN
    # a model's weights are far above glibc's mmap threshold, so this comes fresh from mmap, no page touched yet
    pages = -(-total // HUGE) * HUGE
    buffer = torch.empty(pages + HUGE, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE   # the first 2 MB boundary inside it
    advised = total >= HUGE and _advise(buffer.data_ptr() + start, pages)
    out = []
    for t, off, n in zip(tensors, offsets, sizes):
        view = buffer[start + off: start + off + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out, advised
