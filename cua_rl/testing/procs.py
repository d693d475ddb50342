"""The processes a browser gym or a training started (Linux ``/proc``), for leak tests, memory
figures and the model server's port.

Chromium runs as a family of processes (browser, zygotes, GPU, network, one renderer per
browser context) below Playwright's driver, all descendants of the process that started the
gym. ``chromium_processes(root)`` lists them by walking parent links, and ``pss_bytes`` sums
their proportional set size (shared pages split between the processes sharing them), the fair
per-process memory figure when many renderers share Chromium's code.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

PROC = Path("/proc")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def descendants(root: int | None = None) -> list[int]:
    """Every live process below ``root`` (default: this process)."""
    kids, found = _children(), []
    stack = [os.getpid() if root is None else root]
    while stack:
        for pid in kids.get(stack.pop(), []):
            found.append(pid)
            stack.append(pid)
    return found


def _running_chromium(pid: int) -> bool:
    """A chromium process that has not exited (an exited one waits, a zombie, until its parent
    reaps it, and keeps its name meanwhile; a reused pid runs something else)."""
    try:
        comm = (PROC / str(pid) / "comm").read_text().strip()
        state = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return comm in ("chromium", "chrome") and state not in ("Z", "X")


def _cmdline(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def chromium_processes(root: int | None = None, kind: str | None = None) -> list[int]:
    """Chromium processes at or below ``root`` (default: below this process); ``kind`` keeps
    one ``--type`` (e.g. ``renderer``; ``""`` is the browser process itself)."""
    found = []
    for pid in ([root] if root is not None else []) + descendants(root):
        if not _running_chromium(pid):
            continue
        cmd = _cmdline(pid)
        ptype = next((a[7:] for a in cmd.split() if a.startswith("--type=")), "")
        if kind is None or ptype == kind:
            found.append(pid)
    return found


def alive(pids: set[int] | list[int]) -> list[int]:
    """Those of ``pids`` still running as chromium."""
    return [pid for pid in pids if _running_chromium(pid)]


def pss_bytes(pids: list[int]) -> int:
    """Summed proportional set size of ``pids`` (processes that exited count 0)."""
    total = 0
    for pid in pids:
        try:
            text = (PROC / str(pid) / "smaps_rollup").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1]) << 10
                break
    return total


def vllm_port(root: int) -> int | None:
    """The port of the vLLM server started below ``root`` (``cua_rl.inference.vllm_server ... --port
    N``, as train.py starts it), read from its command line; None until it runs."""
    for pid in descendants(root):
        cmd = _cmdline(pid)
        if "cua_rl.inference.vllm_server" in cmd and (m := re.search(r"--port (\d+)", cmd)):
            return int(m.group(1))
    return None
