"""Whether a run could create and write the folders its config names, decided without writing.

``--check`` must write nothing, and without a check the training's first write (AReaL's
``config.yaml`` under ``cluster.fileroot``) failed as a traceback. A path's nearest existing
ancestor decides, in three looks, none of which writes: it is not on a kernel pseudo file system
(proc, sysfs, ...), which refuses new entries to root as well (``mkdir /proc/cua``: "No such file
or directory"); its file system is mounted read-write (``statvfs``); and it is a folder this user
may write into (``os.access``, which root passes everywhere). What remains unseen (a quota, a full
disk, an ACL root ignores) fails at the write itself.
"""

from __future__ import annotations

import os
from pathlib import Path

# File systems that hold kernel objects, not files: nothing can be created in them.
PSEUDO_FILE_SYSTEMS = frozenset(
    {"proc", "sysfs", "devpts", "cgroup", "cgroup2", "securityfs", "debugfs", "tracefs", "bpf"}
    | {"pstore", "configfs", "efivarfs", "binfmt_misc", "fusectl", "mqueue", "autofs"}
)


def nearest_existing(path: Path) -> Path:
    """``path`` itself, or the closest ancestor that exists."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor or "/")


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def file_system_type(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the file system ``path`` is on, from the longest mount point above it in
    ``/proc/self/mountinfo`` (None where there is no such file)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    best, found = -1, None
    resolved = str(path.resolve())
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not tail:
            continue
        point = _unescape(parts[4])
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, found = len(point), tail.split()[0]
    return found


def why_unwritable(path: str | Path, *, is_file: bool = False) -> str | None:
    """Why this user could not create (or, existing, write) ``path``; None when it could.
    ``is_file``: the path names a file (an SQLite database) rather than a folder."""
    target = Path(path).expanduser().absolute()
    existing = nearest_existing(target)
    if existing == target:
        if is_file and target.is_dir():
            return f"{target} is a folder, not a file"
        if not is_file and not target.is_dir():
            return f"{target} is a file, not a folder"
        if is_file:
            existing = target
    elif not existing.is_dir():
        return f"{existing} is a file, so nothing can be created below it"
    # What holds for every user first, so that root and others read the same reason.
    kind = file_system_type(existing)
    if kind in PSEUDO_FILE_SYSTEMS:
        return f"{existing} is on a {kind} file system, which takes no new files or folders"
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"{existing} is on a read-only file system"
    if not os.access(existing, os.W_OK | (0 if existing.is_file() else os.X_OK)):
        return f"{existing} is not writable by this user"
    return None
