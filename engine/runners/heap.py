"""The C heap of a process that runs for hours: fewer arenas, and freed heap given back to the system.

A session's threads (the worker, the views' pollers, a recorder, a server) allocate and free many
small arrays. glibc gives each thread that allocates an arena of its own (up to 8 per core), and each
arena keeps what was freed in it for reuse by that arena, so resident memory holds free heap spread
over many arenas, each fragmented its own way. Two things bound that (bench/soak.py measures it):
- share_arenas(): at most ARENAS arenas for the threads started from now on (mallopt M_ARENA_MAX, as
  the MALLOC_ARENA_MAX variable does at start-up). A session calls it before starting its threads.
- release_free_heap(): malloc_trim(0) returns the free pages of every arena; a running session calls it
  once a minute (in the soak: resident memory about 25 MiB lower).
Elsewhere (macOS, musl) both are absent and do nothing.
"""
from __future__ import annotations

import ctypes

ARENAS = 2
_M_ARENA_MAX = -8  # glibc's malloc.h


def _libc_function(name: str):
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_function("malloc_trim")
_MALLOPT = _libc_function("mallopt")


def release_free_heap() -> bool:
    """Give the free pages of the C heap back to the system; True when some were."""
    if _MALLOC_TRIM is None:
        return False
    return bool(_MALLOC_TRIM(0))


def share_arenas(arenas: int = ARENAS) -> bool:
    """Let threads started from now on share at most `arenas` heap arenas; True when glibc took it."""
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(_M_ARENA_MAX, int(arenas)))
