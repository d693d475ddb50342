"""Peak resident memory of one stretch of code in this process (Linux), for CPU measurements.

There is no ``torch.cuda.max_memory_allocated`` on CPU. Two kernel features give the same
figure: writing ``5`` to ``/proc/self/clear_refs`` resets the peak RSS (``VmHWM``) to the
current RSS, and ``VmHWM`` then records the highest RSS reached. glibc would keep freed tensors
in its heap (RSS that no longer holds live data), so ``release_freed_memory()`` first makes every
allocation above 64 KiB its own mapping, returned to the kernel when freed.
"""

from __future__ import annotations

import ctypes
import re
import time
from dataclasses import dataclass
from pathlib import Path

_M_MMAP_THRESHOLD = -3
_STATUS = Path("/proc/self/status")


def release_freed_memory(threshold: int = 64 << 10) -> None:
    """Serve allocations above ``threshold`` bytes by mmap, so RSS tracks live memory."""
    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) refused: not glibc?")


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{_STATUS} has no {field}: peak RSS needs Linux")
    return int(match.group(1))


def rss_bytes() -> int:
    """This process's resident memory now."""
    return _status_kib("VmRSS") << 10


@dataclass
class Peak:
    """RSS before the measured code, the highest RSS during it, and its wall time."""

    before: int = 0
    peak: int = 0
    seconds: float = 0.0

    @property
    def added(self) -> int:
        """Bytes the code needed on top of what the process held before it."""
        return self.peak - self.before


class peak_rss:
    """``with peak_rss() as p: ...`` then ``p.added``, ``p.peak`` (bytes), ``p.seconds``."""

    def __enter__(self) -> Peak:
        Path("/proc/self/clear_refs").write_text("5")
        self.result = Peak(before=_status_kib("VmRSS") << 10)
        self._start = time.perf_counter()
        return self.result

    def __exit__(self, *exc: object) -> None:
        self.result.seconds = time.perf_counter() - self._start
        self.result.peak = _status_kib("VmHWM") << 10
