"""Stored episodes through the monitor: the worker's client over real HTTP to a real monitor on
a SQLite file, the spool while it is down, refusals counted, the replay query, retention."""

from __future__ import annotations

import sqlite3

import pytest

from cua_rl.monitor.protocol import EPISODE_KIND
from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.server.screenshots import ScreenshotStore
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.monitor.worker.client import MonitorClient
from cua_rl.monitor.worker.settings import MonitorClientConfig
from cua_rl.serving import ThreadedServer
from cua_rl.warehouse import rebuild_rows, to_record
from tests.monitor.conftest import MonitorProcess

from .conftest import RUN, TASK, assert_rows_equal, rollout_batch, stored


@pytest.fixture
def served(tmp_path):
    store = MonitorStore(tmp_path / "monitor.db")
    with ThreadedServer(create_app(store), name="monitor") as server:
        server.store = store
        yield server
    store.close()


def _client(url: str, tmp_path, **changes) -> MonitorClient:
    cfg = MonitorClientConfig(
        base_url=url,
        spool_path=str(tmp_path / "spool.jsonl"),
        backoff_initial_s=0.01,
        backoff_max_s=0.02,
        replay_interval_s=0.05,
        **changes,
    )
    return MonitorClient(cfg)


async def _record(client: MonitorClient, ep) -> None:
    """The rollout (as the recorder sends it), then the episode."""
    for kind, records in rollout_batch(ep.rollout_uuid, ep.task_id).items():
        for record in [records] if kind == "training" else records:
            client.enqueue(kind, record)
    assert client.store_episode(ep)


def _stored_rows(db_path) -> list[tuple]:
    with sqlite3.connect(db_path) as db:
        return db.execute("SELECT client_id, task_id, success FROM episode_store").fetchall()


async def test_recorded_successes_come_back_and_rebuild_exactly(
    images, processor, served, tmp_path
):
    ep, result = stored(images, processor, uuid="r-ok")
    other, _ = stored(images, processor, uuid="r-other-task", task="task-b")
    failed, _ = stored(images, processor, uuid="r-failed", success=False)
    async with _client(served.url, tmp_path) as client:
        for e in (ep, other, failed):
            await _record(client, e)
        assert await client.flush(30)
        assert client.counters.dropped == 0, client.counters.last_error
        found = await client.successes(TASK, [RUN], min_version=3, limit=5)
        assert [e.rollout_uuid for e in found] == ["r-ok"]
        assert_rows_equal(rebuild_rows(found[0], processor), result.rows)
        # Another task's success, a success older than asked and another training's are not
        # answered.
        assert await client.successes("task-c", [RUN], min_version=0, limit=5) == []
        assert await client.successes(TASK, [RUN], min_version=4, limit=5) == []
        assert await client.successes(TASK, ["another-run"], min_version=0, limit=5) == []
        assert len(await client.successes(TASK, [], min_version=0, limit=5)) == 1
        # Nor one with a token sampled after the version asked for (replay cannot use it).
        last = ep.version_max
        assert await client.successes(TASK, [RUN], 0, 5, max_version=last - 1) == []
        got = await client.successes(TASK, [RUN], 0, 5, max_version=last)
        assert [e.rollout_uuid for e in got] == ["r-ok"]
    assert len(_stored_rows(served.store.path)) == 3
    # Each image stored once for the three episodes.
    with sqlite3.connect(served.store.path) as db:
        assert db.execute("SELECT COUNT(*) FROM screenshot").fetchone()[0] == len(ep.images)


async def test_malformed_store_records_are_refused_and_counted(images, processor, served, tmp_path):
    good, _ = stored(images, processor, uuid="r-good")
    bad = to_record(stored(images, processor, uuid="r-bad")[0])
    bad["rows"][0]["tokens"] += 1  # lengths that disagree with the blob
    unknown_rollout = to_record(stored(images, processor, uuid="r-nobody")[0])
    async with _client(served.url, tmp_path) as client:
        await _record(client, good)
        client.enqueue(EPISODE_KIND, bad)
        client.enqueue(EPISODE_KIND, unknown_rollout)
        client.enqueue("episode_images", {"sha256": "0" * 64, "data": "aGVsbG8="})
        assert await client.flush(30)
        assert client.counters.refused == {
            "episodes.data": 1,
            "episodes.rollout_client_id": 1,
            "episode_images.data": 1,
        }
        assert client.counters.dropped == 3
    assert [r[0] for r in _stored_rows(served.store.path)] == ["r-good:episode"]


async def test_a_record_sent_twice_is_stored_once(images, processor, served, tmp_path):
    ep, _ = stored(images, processor, uuid="r-twice")
    async with _client(served.url, tmp_path) as client:
        await _record(client, ep)
        client.enqueue(EPISODE_KIND, to_record(ep))  # a spool replay of a committed batch
        assert await client.flush(30)
        assert client.counters.dropped == 0
    assert len(_stored_rows(served.store.path)) == 1


async def test_the_monitor_down_during_upload_loses_nothing(images, processor, tmp_path):
    ep, result = stored(images, processor, uuid="r-spooled")
    monitor = MonitorProcess(tmp_path / "served.db", token=None)
    monitor.start()
    try:
        client = _client(monitor.base_url, tmp_path, max_retries=0)
        await client.start()
        for kind, records in rollout_batch(ep.rollout_uuid).items():
            for record in [records] if kind == "training" else records:
                client.enqueue(kind, record)
        assert await client.flush(30)
        monitor.kill()
        assert client.store_episode(ep)
        # Nothing answers: the episode and its images go to the spool, and stay there.
        assert not await client.flush(1.0)
        await client.close(timeout=1.0)
        assert client.counters.spooled >= 1 + len(ep.images)
        assert client.counters.dropped == 0
        monitor.start()  # the same port and database
        async with _client(monitor.base_url, tmp_path) as replayer:
            assert await replayer.flush(30)
            assert replayer.counters.replayed >= 1 + len(ep.images)
            found = await replayer.successes(TASK, [RUN], min_version=0, limit=1)
        assert_rows_equal(rebuild_rows(found[0], processor), result.rows)
    finally:
        monitor.stop()


def test_retention_keeps_the_images_a_stored_episode_needs(images, processor, tmp_path):
    ep, _ = stored(images, processor, uuid="r-kept")
    store = MonitorStore(tmp_path / "monitor.db")
    shots = ScreenshotStore(store.path, max_image_bytes=1024, max_total_bytes=1024)
    try:
        for digest, data in ep.images.items():
            shots._conn.execute(  # noqa: SLF001 - the row a put of a larger image would add
                "INSERT INTO screenshot (sha256, mime, bytes, width, height) VALUES "
                "(?, 'image/png', ?, 1, 1)",
                (digest, len(data)),
            )
            shots.path_of(digest).parent.mkdir(exist_ok=True)
            shots.path_of(digest).write_bytes(data)
        store.ingest(rollout_batch(ep.rollout_uuid))
        store.ingest({EPISODE_KIND: [to_record(ep)]})
        from tests.trajectory.conftest import solid_png

        small = solid_png(8, 8)
        import hashlib

        shots._total = 10_000  # noqa: SLF001 - over the bound: the next put enforces it
        shots.put(hashlib.sha256(small).hexdigest(), small)
        for digest in ep.images:
            assert shots.get(digest) is not None
    finally:
        shots.close()
        store.close()


async def test_an_image_dropped_from_a_full_queue_is_sent_with_the_next_episode(
    images, processor, served, tmp_path
):
    ep, result = stored(images, processor, uuid="r-full")
    client = _client(served.url, tmp_path, max_queue_records=5)
    for kind, records in rollout_batch(ep.rollout_uuid).items():  # 4 records
        for record in [records] if kind == "training" else records:
            client.enqueue(kind, record)
    # Room for one image: the other and the episode are dropped (counted), not remembered.
    assert not client.store_episode(ep)
    assert client.counters.dropped == 2
    async with client:
        assert await client.flush(30)
        assert client.store_episode(ep)  # as a later episode holding the same images
        assert await client.flush(30)
        found = await client.successes(TASK, [RUN], min_version=0, limit=1)
    assert_rows_equal(rebuild_rows(found[0], processor), result.rows)
