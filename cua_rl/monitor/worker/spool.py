"""The client's spool file: one JSON batch a line, appended durably, replayed in order.

A line is flushed and fsynced before the append returns, so a batch the client spooled survives
the process; after a replay only the replayed prefix is dropped (written to a temporary file,
then renamed), so lines appended meanwhile stay, in order.
"""

from __future__ import annotations

import os
from pathlib import Path


def append_line(path: Path, line: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_lines(path: Path) -> list[str]:
    try:
        return [ln for ln in path.read_text().splitlines() if ln.strip()]
    except FileNotFoundError:
        return []


def drop_prefix(path: Path, n: int) -> int:
    lines = read_lines(path)[n:]
    if not lines:
        path.unlink(missing_ok=True)
        return 0
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(ln + "\n" for ln in lines))
    os.replace(tmp, path)
    return len(lines)
