"""Run a command and report the peak summed RSS of its whole process tree.

``python scripts/peak_rss.py -- make demo`` prints the command's output as usual, then one line:
``peak_rss_gib=5.12 wall_s=130.4 rc=0``. The tree is found through /proc parent links on every
sample, so processes that start their own session (the demo's services, AReaL's workers and the
vLLM server) are counted as long as their parent chain leads back to the command. Linux only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def _snapshot() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, rss bytes) for every process readable now."""
    out: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # The command name may contain spaces and parentheses: split after the last ')'.
            fields = stat[stat.rindex(")") + 2 :].split()
            ppid, rss_pages = int(fields[1]), int(fields[21])
        except (OSError, ValueError, IndexError):
            continue
        out[int(entry.name)] = (ppid, rss_pages * PAGE)
    return out


def tree_rss(root: int) -> int:
    procs = _snapshot()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        if pid in procs:
            total += procs[pid][1]
        stack.extend(children.get(pid, []))
    return total


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    t0 = time.monotonic()
    proc = subprocess.Popen(argv)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, tree_rss(proc.pid))
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        rc = proc.wait()
    stop.set()
    sampler.join()
    print(f"peak_rss_gib={peak / 2**30:.2f} wall_s={time.monotonic() - t0:.1f} rc={rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
