"""Bytes a long-running service must keep serving, held on disk instead of in its memory.

The local gym keeps each terminated execution's screenshots fetchable for an hour, and the
local agent keeps each finished run's events readable: held in memory, both grew the process
for as long as they were kept (docs/soak.md). ``Spill`` writes one key's parts (several byte
strings) back to back into one file and leaves only their end offsets in memory. The files live
in a directory of its own (under ``parent``, or the system's temporary directory), made on the
first write and removed with everything in it by ``close``. Writes and reads are synchronous on
purpose: a few small parts per call on a local disk, and doing them in the caller's event loop
keeps the hand-over atomic (never a moment where the data is neither in memory nor on disk).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Spilled:
    """Where one key's parts are: a file and each part's end offset in it."""

    path: str
    ends: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.ends[-1] if self.ends else 0


class Spill:
    def __init__(self, parent: str = "", prefix: str = "cua-spill-"):
        self.parent = parent
        self.prefix = prefix
        self.root: str | None = None

    def write(self, key: str, parts: list[bytes]) -> Spilled:
        """Store ``parts`` under ``key`` (a file name); raises ``OSError`` if the disk does."""
        if self.root is None:
            self.root = tempfile.mkdtemp(prefix=self.prefix, dir=self.parent or None)
        path = os.path.join(self.root, key)
        ends, at = [], 0
        with open(path, "wb") as f:
            for part in parts:
                f.write(part)
                at += len(part)
                ends.append(at)
        return Spilled(path, tuple(ends))

    @staticmethod
    def read(spilled: Spilled, index: int) -> bytes | None:
        """Part ``index``, or None when there is no such part."""
        if not 0 <= index < len(spilled.ends):
            return None
        start = spilled.ends[index - 1] if index else 0
        with open(spilled.path, "rb") as f:
            f.seek(start)
            return f.read(spilled.ends[index] - start)

    @staticmethod
    def remove(spilled: Spilled) -> None:
        try:
            os.remove(spilled.path)
        except FileNotFoundError:
            pass  # close() removed the directory already

    def close(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
