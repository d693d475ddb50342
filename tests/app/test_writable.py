"""Whether a run's folders could be created, decided without writing (cua_rl/app/writable.py)."""

from __future__ import annotations

from pathlib import Path

from cua_rl.app import train
from cua_rl.app.writable import file_system_type, why_unwritable
from cua_rl.testing.cache import ensure_model

ROOT = Path(__file__).resolve().parents[2]

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
31 27 0:30 / /mnt/my\\040disk ro,relatime - vfat /dev/sdb1 ro
"""


def test_the_longest_mount_point_above_a_path_names_its_file_system(tmp_path):
    assert file_system_type(Path("/proc/1/status"), MOUNTINFO) == "proc"
    assert file_system_type(Path("/procfoo"), MOUNTINFO) == "ext4"  # a prefix, not a parent
    assert file_system_type(Path("/mnt/my disk/runs"), MOUNTINFO) == "vfat"
    assert file_system_type(Path("/"), MOUNTINFO) == "ext4"


def test_what_cannot_be_created_is_named_and_nothing_is_written(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "proc file system" in why_unwritable("/proc/cua/runs")
    assert (
        why_unwritable(a_file / "runs") == f"{a_file} is a file, so nothing can be created below it"
    )
    assert why_unwritable(a_file) == f"{a_file} is a file, not a folder"
    assert why_unwritable(tmp_path, is_file=True) == f"{tmp_path} is a folder, not a file"
    assert why_unwritable(tmp_path / "a" / "b") is None
    assert why_unwritable(tmp_path / "a" / "monitor.db", is_file=True) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_training_on_an_unwritable_fileroot_is_one_config_error(tmp_path, capsys):
    # Not --check: the load that would write config.yaml there stops first (it was a traceback).
    rc = train.main(
        [
            "--config", str(ROOT / "configs" / "local.yaml"),
            f"actor.path={ensure_model('qwen2-vl-byte')}",
            "cluster.fileroot=/proc/cua-rl-train",
            f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [
        "config error: cluster.fileroot=/proc/cua-rl-train cannot be created or written: /proc "
        "is on a proc file system, which takes no new files or folders; set cluster.fileroot "
        "to a place this user can write (command line: cluster.fileroot=/proc/cua-rl-train)"
    ]
    assert list(tmp_path.iterdir()) == []
