"""``Spill``: parts read back as written, segments freed once their entries are gone, nothing
named on disk."""

from __future__ import annotations

import pytest

from cua_rl.core.spill import Spill
from tests.conftest import open_files_under


def test_parts_read_back_byte_identical_across_segments(tmp_path):
    spill = Spill(str(tmp_path), segment_bytes=100)
    entries = [[bytes([i]) * (30 + i), b"", bytes([i + 100]) * 7] for i in range(8)]
    spilled = [spill.write(parts) for parts in entries]
    for parts, where in zip(entries, spilled, strict=True):
        assert [Spill.read(where, i) for i in range(3)] == parts
        assert Spill.read(where, 3) is None and Spill.read(where, -1) is None
        assert where.size == sum(map(len, parts))
    assert 2 <= len(spill.segments) < 8
    assert list(tmp_path.iterdir()) == []
    assert len(open_files_under(tmp_path)) == len(spill.segments)
    spill.close()
    assert open_files_under(tmp_path) == []


def test_a_segment_is_freed_when_its_entries_are_removed_and_a_newer_one_is_written(tmp_path):
    spill = Spill(str(tmp_path), segment_bytes=10)
    first, second = spill.write([b"a" * 10]), spill.write([b"b" * 10])
    assert len(spill.segments) == 2 and spill.disk_bytes == 20
    spill.remove(first)
    assert len(spill.segments) == 1 and spill.disk_bytes == 10
    assert Spill.read(second, 0) == b"b" * 10
    spill.remove(second)  # the segment being written stays open for the next entry
    assert len(spill.segments) == 1
    third = spill.write([b"c"])
    assert len(spill.segments) == 1 and Spill.read(third, 0) == b"c"
    spill.close()


def test_a_folder_that_cannot_hold_files_is_an_os_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(OSError):
        Spill(str(not_a_dir)).write([b"x"])
