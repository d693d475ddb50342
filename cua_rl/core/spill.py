"""Bytes a long-running service must keep serving, held on disk instead of in its memory.

The local gym keeps each terminated execution's screenshots fetchable for an hour, and the
local agent keeps each finished run's record readable: held in memory, both grew the process for
as long as they were kept (docs/soak.md). ``Spill`` appends one key's parts (several byte
strings) to a file and leaves only their offsets in memory.

The files have no name: each is a temporary file unlinked at once (under ``parent``, or the
system's temporary directory), so the kernel frees it when its descriptor closes, even when the
process is killed and nothing of it runs to clean up. Entries go into one segment file until it
holds ``segment_bytes``, then into a new one; a segment is closed (its space freed) once every
entry in it was removed and a newer one is being written. The services drop their oldest
entries first, so segments are freed in turn. Writes and reads are synchronous on purpose: a
few small parts per call on a local disk, and doing them in the caller's event loop keeps the
hand-over atomic (never a moment where the data is neither in memory nor on disk).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

SEGMENT_BYTES = 64 * 2**20


class _Segment:
    def __init__(self, parent: str):
        self.file = tempfile.TemporaryFile(dir=parent or None)
        self.size = 0
        self.live = 0

    def append(self, parts: list[bytes]) -> int:
        start = self.size
        for part in parts:
            view = memoryview(part)
            while view:
                n = os.pwrite(self.file.fileno(), view, self.size)
                view, self.size = view[n:], self.size + n
        self.live += 1
        return start


@dataclass(frozen=True)
class Spilled:
    """Where one key's parts are: a segment, where they start in it, each part's end offset."""

    segment: _Segment
    start: int
    ends: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.ends[-1] if self.ends else 0


class Spill:
    def __init__(self, parent: str = "", segment_bytes: int = SEGMENT_BYTES):
        self.parent = parent
        self.segment_bytes = segment_bytes
        self.segments: list[_Segment] = []  # open ones, oldest first; the last one is written

    def write(self, parts: list[bytes]) -> Spilled:
        """Store ``parts``; raises ``OSError`` if the disk does (nothing is kept then)."""
        if not self.segments or self.segments[-1].size >= self.segment_bytes:
            self.segments.append(_Segment(self.parent))
            self._close_empty()
        segment = self.segments[-1]
        before = segment.size
        try:
            start = segment.append(parts)
        except OSError:
            segment.size = before  # what was written of it is overwritten by the next entry
            raise
        ends, at = [], 0
        for part in parts:
            at += len(part)
            ends.append(at)
        return Spilled(segment, start, tuple(ends))

    @staticmethod
    def read(spilled: Spilled, index: int) -> bytes | None:
        """Part ``index``, or None when there is no such part (or the spill was closed)."""
        if not 0 <= index < len(spilled.ends) or spilled.segment.file.closed:
            return None
        begin = spilled.ends[index - 1] if index else 0
        n = spilled.ends[index] - begin
        return os.pread(spilled.segment.file.fileno(), n, spilled.start + begin)

    def remove(self, spilled: Spilled) -> None:
        spilled.segment.live -= 1
        self._close_empty()

    def _close_empty(self) -> None:
        for segment in self.segments[:-1]:
            if segment.live <= 0:
                segment.file.close()
        self.segments = [s for s in self.segments if not s.file.closed]

    @property
    def disk_bytes(self) -> int:
        """Bytes the open segments take on disk (removed entries included until freed)."""
        return sum(s.size for s in self.segments)

    def close(self) -> None:
        for segment in self.segments:
            segment.file.close()
        self.segments = []
