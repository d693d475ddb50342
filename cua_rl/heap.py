"""Give the heap's free pages back to the OS (glibc's ``malloc_trim``).

A rollout worker processes every screenshot of an episode in pool threads (the gateway's image
pads, the row's pixel values), and the actor allocates tensors of new shapes at every update.
glibc keeps what is freed in per-thread arenas for reuse and gives memory back to the OS only
from the top of the main heap, so both processes' RSS crept up over a soak (x1.55 in 20 minutes,
docs/soak.md) while Python's own heap stayed flat. ``release_free_memory()`` after each episode's
conversion and each actor update returns the free pages of every arena; ``bench/heap_trim.py``
measures what it saves and costs. Where the C library has no ``malloc_trim`` it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Return free heap pages to the OS; False where the C library cannot (then a no-op)."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
