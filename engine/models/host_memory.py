"""Host memory for large weights, backed by huge pages where Linux gives them.

Decode reads every weight once per token, so it runs at the rate memory streams. With 4 KiB pages
that stream misses the TLB every 4 KiB; with 2 MiB pages every 2 MiB. llama.cpp reads its weights
from the mmap'd GGUF, which recent kernels keep in large page-cache folios; kvscope's weights are
copies (fused, reordered, converted), so it asks for huge pages itself: an anonymous mapping advised
MADV_HUGEPAGE before it is touched (transparent_hugepage=madvise, the common default, gives huge
pages only to such mappings), then MADV_COLLAPSE for the pieces the page faults left small. Measured
on the 2-core development machine: bench/decode.py's 49 matrices (351 MB, one row-block product each)
7-9% faster than on malloc'd memory (three interleaved runs); a decode step of that model 3-8% faster
(two copies of the model in one process, alternating, three runs; a null run of two plain copies:
1-2%).

Where the system says no (another OS, THP disabled, no huge page free) the memory is ordinary pages:
the weights are the same, only the speed differs. Tensors below HUGE_PAGE_MIN_BYTES get plain
torch.empty: a huge page is 2 MiB.
"""
from __future__ import annotations

import math
import mmap
import sys

import torch

HUGE_PAGE_MIN_BYTES = 4 << 20
# MADV_COLLAPSE (Linux 6.1, include/uapi/asm-generic/mman-common.h); Python's mmap module names it
# only when built against headers that have it
MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor, in huge pages when it is large and the system gives them."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_MIN_BYTES or sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    # anonymous and private (a shared mapping is shmem, which THP leaves alone); unmapped with the last tensor on it
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP off or not built in: ordinary pages
        pass
    return torch.frombuffer(region, dtype=dtype, count=numel).view(shape)


def collapse_into_huge_pages(t: torch.Tensor) -> None:
    """Ask the kernel to move t's memory into huge pages now (best effort, silent where refused):
    page faults give small pages when no huge page was free at that moment."""
    base = t.untyped_storage()
    if t.device.type != "cpu" or base.nbytes() < HUGE_PAGE_MIN_BYTES or sys.platform != "linux":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    start = base.data_ptr() // page * page
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(base.data_ptr() + base.nbytes() - start), MADV_COLLAPSE)


def into_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor t in huge-page memory (t itself when small, not on the CPU, or
    part of an autograd graph: training keeps its tensors as they are)."""
    if t.device.type != "cpu" or t.requires_grad or t.numel() * t.element_size() < HUGE_PAGE_MIN_BYTES:
        return t.contiguous()
    out = huge_page_empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    collapse_into_huge_pages(out)
    return out
