"""A monitor process SIGKILLed and restarted in the middle of a recorded run: every record ends up
in the database exactly once (the client retries and spools while it is down, replays after;
ingest is idempotent by client id, and a batch committed just before the kill, whose answer was
lost, is not applied again: its idempotency key). Real process, real HTTP on loopback, real
SQLite file. The lost answer itself is forced in test_client.py (``AnswersLost``); here the kill
lands wherever it lands."""

from __future__ import annotations

import asyncio
import collections
import json
import sqlite3

import pytest

from cua_rl.monitor.worker.client import MonitorClient, MonitorClientConfig
from cua_rl.monitor.worker.context import MonitorContext
from cua_rl.monitor.worker.recorder import RolloutRecorder

from .conftest import MonitorProcess, count_rows, uid

ROLLOUTS, TURNS, ACTIONS = 12, 3, 2
KILL_AT, RESTART_AT = 4, 8  # rollout numbers


async def _record(recorder: RolloutRecorder, r: int) -> None:
    await recorder.start(group=r // 4, env_index=r % 4)
    await recorder.environment("creating")
    await recorder.environment("running", gbox_id=f"box-{r}")
    for n in range(1, TURNS + 1):
        await recorder.turn_start(n)
        await asyncio.sleep(0.01)  # let the client send while the run goes on
        await recorder.turn_end(n, model_response=f"r{r} t{n}", timings={"model_s": 0.1})
        for i in range(ACTIONS):
            await recorder.action(n, i, "tap", {"r": r, "n": n, "i": i}, tokens=[1, 2, 3])
        await recorder.observation(n, 0, obs_type="screenshot", screenshot_uri=f"{r}-{n}.png")
    await recorder.environment("terminated")
    await recorder.validation(success=r % 2 == 0)
    await recorder.complete(reward=float(r % 2 == 0))


@pytest.mark.slow
async def test_monitor_killed_and_restarted_mid_run_keeps_every_record_once(tmp_path):
    proc = MonitorProcess(tmp_path / "run.db")
    await asyncio.to_thread(proc.start)
    cfg = MonitorClientConfig(
        base_url=proc.base_url,
        token=proc.token,
        flush_interval_s=0.02,
        batch_max_records=25,
        request_timeout_s=2.0,
        max_retries=1,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
        replay_interval_s=0.2,
        spool_path=str(tmp_path / "spool.jsonl"),
    )
    client = MonitorClient(cfg)
    await client.start()
    uuids = []
    try:
        run = client.training(uid("run-"), log_path="runs/x", model_name="tiny", status="running")
        step = client.step(run, 1, status="rollout_running")
        ctx = MonitorContext(training_id=run, step_id=step)
        for r in range(ROLLOUTS):
            if r == KILL_AT:
                proc.kill()
            if r == RESTART_AT:
                # Bounded wait until the outage has reached the spool, then bring it back.
                for _ in range(200):
                    if client.counters.spooled:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(proc.start)
            uuids.append(uid(f"rollout-{r}-"))
            recorder = RolloutRecorder(
                client, uuids[-1], task_id=f"task-{r % 3}", model_path="m", source=ctx
            )
            await _record(recorder, r)
        client.step(run, 1, status="completed")
        client.training(run, status="completed")
        assert await client.flush(timeout=60), client.counters
    finally:
        await client.close(timeout=5)
        proc.stop()

    counters = client.counters
    # The outage was felt (records went to the spool) and fully recovered from.
    assert counters.spooled > 0 and counters.replayed > 0, counters
    assert counters.dropped == 0, counters
    assert not (tmp_path / "spool.jsonl").exists()

    db = sqlite3.connect(tmp_path / "run.db")
    count = count_rows(
        db,
        (
            "training",
            "step",
            "task",
            "rollout",
            "environment",
            "turn",
            "action",
            "obs",
            "validation",
        ),
    )
    assert count == {
        "training": 1,
        "step": 1,
        "task": 3,
        "rollout": ROLLOUTS,
        "environment": ROLLOUTS,
        "turn": ROLLOUTS * TURNS,
        "action": ROLLOUTS * TURNS * ACTIONS,
        "obs": ROLLOUTS * TURNS,
        "validation": ROLLOUTS,
    }
    rows = db.execute("SELECT rollout_id, status, num_turns, reward FROM rollout").fetchall()
    assert sorted(rows) == sorted(
        (u, "completed", TURNS, float(r % 2 == 0)) for r, u in enumerate(uuids)
    )
    actions = collections.Counter(
        (u, n, json.loads(args)["i"])
        for u, n, args in db.execute(
            "SELECT r.rollout_id, t.turn, a.tool_args FROM action a JOIN turn t ON a.turn_id = t.id "
            "JOIN rollout r ON t.rollout_id = r.id"
        )
    )
    expected = collections.Counter(
        (u, n, i) for u in uuids for n in range(1, TURNS + 1) for i in range(ACTIONS)
    )
    assert actions == expected
    # Replays changed no status twice: each rollout went through its four statuses once.
    history = db.execute(
        "SELECT entity_id, group_concat(new_status, '>') FROM (SELECT * FROM status_history "
        "WHERE entity_type = 'rollout' ORDER BY id) GROUP BY entity_id"
    ).fetchall()
    assert {h for _, h in history} == {"pending>env_creation>running>completed"}
    assert len(history) == ROLLOUTS
    statuses = db.execute(
        "SELECT status FROM training UNION ALL SELECT status FROM step"
    ).fetchall()
    assert statuses == [("completed",), ("completed",)]


@pytest.mark.slow
def test_a_monitor_stopped_by_sigterm_leaves_its_database_whole_in_one_file(tmp_path):
    """SIGTERM (what make demo and a batch scheduler send): the WAL goes back into the file,
    so the .db copied alone, without its -wal, holds every record."""
    import shutil
    import signal

    import httpx

    monitor = MonitorProcess(tmp_path / "m.db")
    monitor.start()
    try:
        for n in range(20):
            batch = {"training": {"client_id": f"t{n}", "run_name": f"t{n}", "log_path": "l",
                                  "model_name": "m", "status": "running"}}  # fmt: skip
            resp = httpx.post(
                f"{monitor.base_url}/api/ingest/batch", json=batch, headers=monitor.headers()
            )
            assert resp.status_code == 200, resp.text
        assert (tmp_path / "m.db-wal").stat().st_size > 0  # the records are in the WAL
    finally:
        monitor.stop()
    assert monitor.proc.returncode == 128 + signal.SIGTERM, monitor.log.read_text()[-2000:]
    assert not (tmp_path / "m.db-wal").exists()
    copy = tmp_path / "copy" / "m.db"
    copy.parent.mkdir()
    shutil.copy(tmp_path / "m.db", copy)
    con = sqlite3.connect(copy)
    try:
        assert con.execute("SELECT COUNT(*) FROM training").fetchone()[0] == 20
    finally:
        con.close()
