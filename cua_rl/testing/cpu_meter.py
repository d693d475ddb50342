"""CPU seconds spent by a process tree, sampled: what a whole training costs on a machine whose
two cores the suite keeps busy (its wall time there says more about what ran beside it).

A process's user and system seconds are read every ``every`` seconds from the root and all its
descendants (psutil); each process ever seen keeps its last reading, so the total only grows. A
process that lives less than one period is missed, one that ends is credited up to its last
reading (an undercount of at most one period each); children's reaped times are not added (they
would count twice what was sampled of them alive). Descendants that leave the tree (a daemon that
double-forks) are not followed.
"""

from __future__ import annotations

import bisect
import os
import threading
import time

import psutil


def tree_cpu_times(root_pid: int) -> dict[tuple[int, float], float]:
    """User plus system CPU seconds of ``root_pid`` and each descendant, by (pid, start time):
    a reused pid is another process (none when the root has gone)."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for proc in procs:
        try:
            with proc.oneshot():
                times, started = proc.cpu_times(), proc.create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        out[(proc.pid, started)] = times.user + times.system
    return out


class TreeCPU:
    """A background sampler of one process tree's cumulative CPU seconds, with its history, so
    that the cost of any past interval can be read (``since``)."""

    def __init__(self, root_pid: int, every: float = 1.0):
        self.root_pid = root_pid
        self.every = every
        self._last: dict[tuple[int, float], float] = {}
        self._times: list[float] = []
        self._totals: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> float:
        readings = tree_cpu_times(self.root_pid)
        with self._lock:
            for key, cpu in readings.items():
                self._last[key] = max(cpu, self._last.get(key, 0.0))
            total = sum(self._last.values())
            self._times.append(time.monotonic())
            self._totals.append(total)
        return total

    def total(self) -> float:
        """The tree's CPU seconds so far (a fresh reading)."""
        return self.sample()

    def since(self, seconds_ago: float) -> float:
        """CPU seconds the tree spent in the last ``seconds_ago`` seconds: now less the last
        reading at or before that moment (0 before the first)."""
        then = time.monotonic() - seconds_ago  # before this reading, which comes after it
        now_total = self.sample()
        with self._lock:
            i = bisect.bisect_right(self._times, then) - 1
            before = self._totals[i] if i >= 0 else 0.0
        return now_total - before

    def start(self) -> TreeCPU:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="tree-cpu", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def stop(self) -> float:
        """Stop sampling; the tree's CPU seconds at the end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.sample()


# The meter of this process's tree for a test session, where every copy of a conftest module
# sees it (pytest may import one conftest under two names: its own and ``tests.conftest``).
_process_meter: TreeCPU | None = None


def start_process_meter(every: float = 1.0) -> TreeCPU:
    global _process_meter
    _process_meter = TreeCPU(os.getpid(), every).start()
    return _process_meter


def process_meter() -> TreeCPU | None:
    return _process_meter


def stop_process_meter() -> None:
    global _process_meter
    if _process_meter is not None:
        _process_meter.stop()
    _process_meter = None
