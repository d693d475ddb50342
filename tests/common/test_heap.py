"""cua_rl.heap on this machine's C library (glibc in CI and here)."""

from __future__ import annotations

import json
import subprocess
import sys

from cua_rl.heap import release_free_memory

# A child process (the threshold is the process's for good): 64 blocks of 1 MiB, each followed
# by a 64 KiB block that stays allocated, so what the big ones leave when freed is in the middle
# of the heap, not at its top. Before them one 4 MiB block is allocated and freed, which in glibc raises the
# mmap threshold to 4 MiB unless it is held. Prints the anonymous RSS (MiB) the freed blocks
# leave behind.
CHILD = """
import ctypes, json, sys
from cua_rl.heap import hold_mmap_threshold
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
held = hold_mmap_threshold() if sys.argv[1] == "held" else None
libc.free(libc.malloc(4 << 20))
before = anon()
big, small = [], []
for _ in range(64):
    p = libc.malloc(1 << 20)
    ctypes.memset(p, 1, 1 << 20)
    big.append(p)
    small.append(libc.malloc(64 << 10))
for p in big:
    libc.free(p)
print(json.dumps({"held": held, "left_mib": anon() - before}))
"""


def _left(case: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, case], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_glibc_gives_free_pages_back():
    blocks = [bytearray(256 * 1024) for _ in range(64)]  # 16 MiB in mmap-sized and heap blocks
    del blocks
    assert release_free_memory() is True


def test_a_held_threshold_keeps_large_blocks_in_their_own_mappings():
    raised, held = _left("raised"), _left("held")
    # glibc's own rule: the freed blocks stay resident between the small ones.
    assert raised["left_mib"] > 48, raised
    # Held: each block had its own mapping, unmapped when freed.
    assert held["held"] is True and held["left_mib"] < 8, held
