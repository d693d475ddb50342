"""release_free_memory on this machine's C library (glibc in CI and here)."""

from __future__ import annotations

from cua_rl.heap import release_free_memory


def test_glibc_gives_free_pages_back():
    blocks = [bytearray(256 * 1024) for _ in range(64)]  # 16 MiB in mmap-sized and heap blocks
    del blocks
    assert release_free_memory() is True
