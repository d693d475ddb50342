"""The client's spool file: one JSON batch a line, appended durably, replayed in order.

A line is flushed and fsynced before the append returns, so a batch the client spooled survives
the process; after a replay only the replayed prefix is dropped (written to a temporary file,
then renamed), so lines appended meanwhile stay, in order.

A spool file has one writer: the replay rewrites it, so two clients on one path (a config's
``spool_path`` shared by the trainer and its rollout workers, or two clients in one process)
would lose each other's lines. A client claims its file with an exclusive ``flock`` on a lock
file beside it, and takes ``name.1.jsonl``, ``name.2.jsonl``, ... while the name is held; the lock
dies with its holder, so a restarted process claims and replays what a dead one left.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

# Clients sharing a spool path at once, beyond which something is wrong (a leak of clients).
MAX_CLAIMS = 256


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


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _numbered(path: Path, n: int) -> Path:
    return path if n == 0 else path.with_name(f"{path.stem}.{n}{path.suffix}")


def try_claim(path: Path) -> int | None:
    """The fd holding ``path``'s lock, or None while another client holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(_lock_path(path), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def claim(path: Path) -> tuple[Path, int]:
    """The first of ``path``, ``path.1``, ... that no other client holds, and its lock's fd."""
    for n in range(MAX_CLAIMS):
        candidate = _numbered(path, n)
        fd = try_claim(candidate)
        if fd is not None:
            return candidate, fd
    raise OSError(f"{MAX_CLAIMS} monitor clients hold spool files named after {path}")


def adopt(path: Path) -> tuple[Path, int] | None:
    """A file named after ``path`` that a client which is gone left with lines to replay, claimed;
    None when there is none (each new client adopts at most one)."""
    siblings = path.parent.glob(f"{path.stem}.*{path.suffix}")
    numbered = sorted(p for p in siblings if p.stem.removeprefix(f"{path.stem}.").isdigit())
    for candidate in [path, *numbered]:
        if not candidate.is_file() or candidate.stat().st_size == 0:
            continue
        fd = try_claim(candidate)
        if fd is not None:
            return candidate, fd
    return None


def release(path: Path, fd: int) -> None:
    """Give the file up; its lock file goes too when nothing is left to replay."""
    try:
        if not path.exists():
            _lock_path(path).unlink(missing_ok=True)
    finally:
        os.close(fd)
