"""``python -m cua_rl.monitor export``: the dataset loads with ``datasets.load_from_disk``, is in
TRL's conversational layout with images, and its token data rebuilds the trained rows exactly;
what cannot be exported is a clear error or a counted skip."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cua_rl.monitor.export import ExportError, episode_from_record, export_training
from cua_rl.monitor.protocol import EPISODE_KIND
from cua_rl.monitor.server.migrations import connect, migrate
from cua_rl.monitor.server.schema import MIGRATIONS
from cua_rl.monitor.server.screenshots import ScreenshotStore
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.warehouse import rebuild_rows, to_record

from .conftest import RUN, assert_rows_equal, rollout_batch, stored


def record_in(db, episodes) -> None:
    """The episodes, their rollouts and their images in a monitor database, as ingest does."""
    store = MonitorStore(db)
    shots = ScreenshotStore(db)
    try:
        for ep in episodes:
            store.ingest(rollout_batch(ep.rollout_uuid, ep.task_id))
            for digest, data in ep.images.items():
                shots.put(digest, data)
            store.ingest({EPISODE_KIND: [to_record(ep)]})
    finally:
        shots.close()
        store.close()


def load(out):
    from datasets import Image, List, load_from_disk

    ds = load_from_disk(str(out))
    return ds, ds.cast_column("images", List(Image(decode=False)))


@pytest.mark.parametrize("break_prefix", [False, True], ids=["one-row", "two-rows"])
def test_the_export_loads_and_rebuilds_the_trained_rows(images, processor, tmp_path, break_prefix):
    ep, result = stored(images, processor, uuid="r-x", break_prefix=break_prefix)
    failed, _ = stored(images, processor, uuid="r-failed", success=False)
    record_in(tmp_path / "monitor.db", [ep, failed])
    lines = []
    report = export_training(tmp_path / "monitor.db", RUN, tmp_path / "out", progress=lines.append)
    assert (report.episodes, dict(report.skipped)) == (2, {})
    ds, raw = load(tmp_path / "out")
    assert len(ds) == 2
    rec = next(r for r in raw if r["rollout_uuid"] == "r-x")
    assert_rows_equal(rebuild_rows(episode_from_record(rec), processor), result.rows)
    # TRL's layout: one image per placeholder, in order; the reply last.
    decoded = next(r for r in ds if r["rollout_uuid"] == "r-x")
    placeholders = [p for m in decoded["messages"] for p in m["content"] if p["type"] == "image"]
    assert len(placeholders) == len(ep.rows[-1].images)
    assert decoded["images"][0].size == (360, 640)  # a PIL image, the first screenshot
    assert decoded["messages"][-1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "tap(1,2)"}],
    }
    # Per turn, the exact sampled ids and logprobs (the hand-built log's second turn).
    assert decoded["turns"][1]["output_ids"] == [60, 61, 62, ep.rows[-1].input_ids[-1]]
    assert decoded["turns"][1]["logprobs"] == [-0.25, -2.0, -0.75, -0.0625]
    assert decoded["success"] and decoded["reward"] == 1.0 and decoded["task_id"] == "task-a"
    assert any("wrote 2 episode(s)" in line for line in lines)


def test_filters_and_skips_are_counted(images, processor, tmp_path):
    ep, _ = stored(images, processor, uuid="r-ok")
    failed, _ = stored(images, processor, uuid="r-failed", success=False)
    lost, _ = stored(images, processor, uuid="r-lost")
    db = tmp_path / "monitor.db"
    record_in(db, [ep, failed])
    store = MonitorStore(db)  # an episode whose images never reached the monitor
    store.ingest(rollout_batch(lost.rollout_uuid))
    lost.rows[0].images = ("f" * 64,)
    store.ingest({EPISODE_KIND: [to_record(lost)]})
    store.close()
    report = export_training(db, RUN, tmp_path / "out", success_only=True, progress=print)
    assert (report.episodes, dict(report.skipped)) == (1, {"image_missing": 1})
    assert [r["rollout_uuid"] for r in load(tmp_path / "out")[0]] == ["r-ok"]


def test_clear_errors(images, processor, tmp_path):
    ep, _ = stored(images, processor, uuid="r-failed", success=False)
    db = tmp_path / "monitor.db"
    record_in(db, [ep])
    with pytest.raises(ExportError, match=r"no training named 'nope'.*newest: wh-run"):
        export_training(db, "nope", tmp_path / "out")
    with pytest.raises(ExportError, match="1 stored episode.*0 of them successes"):
        export_training(db, RUN, tmp_path / "out", success_only=True)
    with pytest.raises(ExportError, match="none matches"):
        export_training(db, RUN, tmp_path / "out", min_reward=2.0)
    old = tmp_path / "old.db"
    migrate(connect(old), MIGRATIONS[:4])
    with pytest.raises(ExportError, match="schema version 4.*migration 5"):
        export_training(old, RUN, tmp_path / "out")


def test_the_command_line(images, processor, tmp_path):
    ep, _ = stored(images, processor, uuid="r-cli")
    db = tmp_path / "monitor.db"
    record_in(db, [ep])
    cmd = [sys.executable, "-m", "cua_rl.monitor", "export", "--db", str(db), "--training"]
    done = subprocess.run(
        [*cmd, RUN, "--success-only", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "wrote 1 episode(s), 2 row(s), 2 image(s)" in done.stderr
    assert len(load(tmp_path / "out")[0]) == 1
    bad = subprocess.run(
        [*cmd, "nope", "--out", str(tmp_path / "o2")], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith("export error: no training named 'nope'")
