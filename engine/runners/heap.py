"""Freed heap given back to the system, for runs that last hours.

A session's threads (the worker, the views' pollers, a recorder, a server) allocate and free many
small arrays. glibc keeps what a thread freed in that thread's arena for reuse, so resident memory
holds free heap that nothing uses (bench/soak.py prints the heap in use and free). malloc_trim(0)
returns the free pages of every arena: in the soak it lowers resident memory by about 25 MiB. The slow
climb that remained (~1 MiB a minute) needed no allocator setting: each watcher's cell history queued up
to 4096 whole events per cache and let go of them at once, and the arenas kept growing to the saw's peaks
(engine/watch/history.py, FLUSH_AT; at 256 a 30-minute soak stays within 2.2% after its warm-up). Fewer arenas
(M_ARENA_MAX 2) slowed that climb in one soak and not in the next, and made the terminal explorer absorb
a fast event stream a third slower (malloc's lock shared by the feed and the UI thread), so threads keep
glibc's arenas. Elsewhere (macOS, musl) this does nothing.
"""
from __future__ import annotations

import ctypes


def _find_malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _find_malloc_trim()


def release_free_heap() -> bool:
    """Give the free pages of the C heap back to the system; True when some were."""
    if _MALLOC_TRIM is None:
        return False
    return bool(_MALLOC_TRIM(0))
