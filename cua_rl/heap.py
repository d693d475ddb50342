"""Keep a long-running worker's heap from creeping: glibc's mmap threshold held, free pages given
back (``malloc_trim``).

A rollout worker processes every screenshot of an episode in pool threads (the gateway's image
pads, the row's pixel values: buffers of a few hundred KiB to a few MiB), and the actor allocates
tensors of new shapes at every update. glibc serves a block above its mmap threshold (128 KiB at
start) with its own mapping, returned to the OS when freed; but each such block freed raises the
threshold to its size (up to 32 MiB), so from then on the same buffers come from the arenas,
where what is freed stays fragmented around live blocks and the RSS creeps (x1.55 in 20 minutes
for both roles in docs/soak.md) while Python's own heap stays flat. ``hold_mmap_threshold()``
sets the threshold once (``mallopt(M_MMAP_THRESHOLD)``), which also turns the raising off, so
large buffers keep their own mappings; ``release_free_memory()`` after each episode's conversion
and each actor update returns the arenas' free pages. ``bench/heap_trim.py`` measures both.
Where the C library is not glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value, held instead of raised


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def _function(name: str, argtypes: list, restype=ctypes.c_int):
    fn = getattr(_LIBC, name, None)  # not glibc: no such function
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


_TRIM = _function("malloc_trim", [ctypes.c_size_t])
_MALLOPT = _function("mallopt", [ctypes.c_int, ctypes.c_int])


def hold_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Serve blocks of ``nbytes`` and more from their own mappings for the rest of the process
    (idempotent); False where the C library cannot."""
    return _MALLOPT is not None and _MALLOPT(M_MMAP_THRESHOLD, nbytes) == 1


def release_free_memory() -> bool:
    """Return free heap pages to the OS; False where the C library cannot (then a no-op)."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
