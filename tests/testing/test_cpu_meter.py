"""The CPU meter behind the suite's budget (cua_rl/testing/cpu_meter.py) on real processes that
burn a known amount of CPU, measured by their own clock (``time.process_time``), one step at a
time on the test's word: nothing here waits for time to pass."""

from __future__ import annotations

import subprocess
import sys

from cua_rl.testing.cpu_meter import TreeCPU, tree_cpu_times

# A process that, for each line it reads, burns that many CPU seconds (its own clock), then says
# "burnt"; with "child" it starts a child of its own running the same loop and relays to it.
BURNER = r"""
import subprocess, sys, time
child = None
for line in sys.stdin:
    word = line.strip()
    if word == "child":
        child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[1]],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        print("started", flush=True)
    elif word.startswith("child "):
        child.stdin.write(word.split(" ", 1)[1] + "\n"); child.stdin.flush()
        print(child.stdout.readline().strip(), flush=True)
    else:
        until = time.process_time() + float(word)
        while time.process_time() < until:
            pass
        print("burnt", flush=True)
"""


def _burner():
    return subprocess.Popen(
        [sys.executable, "-c", BURNER, BURNER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _say(proc, word: str) -> str:
    proc.stdin.write(word + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def test_a_tree_is_credited_what_it_and_its_children_burnt():
    proc = _burner()
    try:
        meter = TreeCPU(proc.pid)
        base = meter.total()  # the interpreter's start-up so far
        assert _say(proc, "child") == "started"
        assert _say(proc, "1.0") == "burnt"
        assert _say(proc, "child 1.5") == "burnt"
        spent = meter.total() - base
        # 2.5 s burnt, plus the child's start-up and the parent's relaying (well under a second);
        # /proc counts in clock ticks (10 ms), so a reading may trail the process's own clock.
        assert 2.45 <= spent < 4.0, spent
        assert len(tree_cpu_times(proc.pid)) == 2
    finally:
        proc.kill()
        proc.wait()


def test_an_ended_process_keeps_its_reading_and_since_reads_an_interval():
    import time

    proc = _burner()
    meter = TreeCPU(proc.pid)
    try:
        assert _say(proc, "0.5") == "burnt"
        first = meter.total()
        mark = time.monotonic()  # after the reading: since() starts from it
        assert first >= 0.45
        assert _say(proc, "1.0") == "burnt"
        spent = meter.since(time.monotonic() - mark)
        assert 0.95 <= spent < 1.5, spent  # ticks of 10 ms against the process's own clock
    finally:
        proc.kill()
        proc.wait()
    ended = meter.total()
    assert ended >= first + 0.95
    assert tree_cpu_times(proc.pid) == {}
    assert meter.total() == ended  # gone from the tree, not from the total
