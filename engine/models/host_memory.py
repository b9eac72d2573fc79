"""Large weights in huge pages, where Linux gives them.

Decode reads every weight once per token, so it runs at the rate memory streams. With 4 KiB pages
that stream misses the TLB every 4 KiB; with 2 MiB pages every 2 MiB. llama.cpp reads its weights
from the mmap'd GGUF, which recent kernels keep in large page-cache folios; kvscope's weights are
copies (decoded, fused, reordered, converted) in ordinary anonymous memory, so it asks for huge pages
for them in place, without another copy: madvise(MADV_HUGEPAGE) marks the range (khugepaged keeps it
so; transparent_hugepage=madvise, the common default, gives huge pages only to marked ranges) and
madvise(MADV_COLLAPSE, Linux 6.1) moves its whole 2 MiB pieces into huge pages now.

Measured on the 2-core development machine: bench/decode.py's 49 matrices (351 MB, one row-block
product each) stream 7-9% faster from huge pages (three interleaved runs). NumPy already advises its
own large arrays, so the matrices decoded from a GGUF straight into numpy had them; the ones torch
makes (fused gate/up, reordered Q/K/V, converted dtypes) did not. A decode step of that model, all
of them advised vs numpy's alone: 1-4% faster (two copies in one process, alternating, three runs).

Where the system says no (another OS, THP off, an older kernel, no huge page free) nothing changes:
the weights are the same, only the speed differs.
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import torch

HUGE_PAGE_MIN_BYTES = 4 << 20  # smaller tensors hold one huge page at most
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
# include/uapi/asm-generic/mman-common.h; Python's mmap module names it only when built against headers that have it
MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)
_HUGE_PAGE = 2 << 20

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise = libc.madvise
    return _madvise


def huge_page_range(t: torch.Tensor) -> tuple[int, int] | None:
    """The 2 MiB-aligned (start, length) inside t's storage that huge pages can back, or None when
    t is not a large CPU tensor on Linux."""
    if t.device.type != "cpu" or sys.platform != "linux":
        return None
    storage = t.untyped_storage()
    if storage.nbytes() < HUGE_PAGE_MIN_BYTES:
        return None
    begin, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    start = -(-begin // _HUGE_PAGE) * _HUGE_PAGE  # only whole huge pages inside t: its neighbours' bytes stay as they are
    stop = end // _HUGE_PAGE * _HUGE_PAGE
    return (start, stop - start) if stop > start else None


def advise_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """Ask the kernel to back t's memory with huge pages, in place (best effort: refusals are silent).
    Returns t."""
    span = huge_page_range(t)
    if span is None:
        return t
    madvise = _libc_madvise()
    start, length = span
    if madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0:
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_COLLAPSE)
    return t
