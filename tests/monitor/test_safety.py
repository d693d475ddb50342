"""The monitor's safety net (cua_rl/monitor/server/safety.py) on temp-file stores, over real HTTP
to ``python -m cua_rl.monitor serve``, and on the dashboard's pages.

Time is injected: the reaper is given ``now``, or the database holds a training whose last sign
of life is years old before the server starts; no test waits for a clock.
"""

from __future__ import annotations

import re
import sqlite3
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from cua_rl.monitor.server.safety import timestamp
from cua_rl.monitor.server.store import MonitorStore

from .conftest import MonitorProcess, uid

OPEN_ROLLOUT = ("pending", "env_creation", "agent_init", "running")
# The trainer's clock in these tests: ahead of the monitor's receipt times, so the heartbeat it
# stamps is always the last sign of life the reaper reads. Set when the module is collected, so a
# week ahead: an hour was overtaken by a suite that ran over an hour on a loaded machine.
T0 = datetime.now(UTC).replace(microsecond=0) + timedelta(days=7)
LONG_AGO = "2020-01-01 00:00:00.000000"


def _run(name: str, *, training: dict | None = None, beat: datetime = T0) -> dict:
    """A training with one step, one eval and a baseline, each with rollouts in every state
    that matters (two open, one finished) and an environment per rollout."""
    step, ev, base = f"step-{name}-1-0", f"eval-{name}-1", f"baseline-{name}-0"
    rollouts, envs = [], []
    sources = (("step_client_id", step), ("eval_client_id", ev), ("baseline_client_id", base))
    for ref, source in sources:
        for status, env in (("running", "running"), ("pending", "creating"),
                            ("completed", "terminated")):  # fmt: skip
            u = uid(f"{name}-r-")
            rollouts.append({"client_id": u, "rollout_id": u, ref: source, "task_client_id": "t",
                             "model_path": "m", "status": status})  # fmt: skip
            envs.append({"client_id": f"{u}:env", "rollout_client_id": u, "env_type": "sim",
                         "status": env})  # fmt: skip
    return {
        "training": {"run_name": name, "log_path": "l", "model_name": "m", "status": "running",
                     "last_heartbeat": timestamp(beat), **(training or {})},
        "tasks": [{"client_id": "t", "task_id": "t", "name": "t", "description": "d"}],
        "steps": [{"client_id": step, "training_client_id": name, "step": 1,
                   "status": "rollout_running"}],
        "evals": [{"client_id": ev, "training_client_id": name, "step": 1, "model_path": "m",
                   "status": "running"}],
        "baselines": [{"client_id": base, "training_client_id": name, "model_path": "m",
                       "status": "running"}],
        "rollouts": rollouts,
        "environments": envs,
    }  # fmt: skip


def _db(store: MonitorStore) -> sqlite3.Connection:
    conn = sqlite3.connect(store.path)
    conn.row_factory = sqlite3.Row
    return conn


def _under(conn, training_id: int, table: str) -> list[sqlite3.Row]:
    """Rows of ``rollout`` or ``environment`` under one training, whatever their source."""
    rollouts = (
        "SELECT r.id FROM rollout r WHERE "
        "r.step_id IN (SELECT id FROM step WHERE training_id = :t) "
        "OR r.eval_id IN (SELECT id FROM eval WHERE training_id = :t) "
        "OR r.baseline_id IN (SELECT id FROM baseline WHERE training_id = :t)"
    )
    where = f"id IN ({rollouts})" if table == "rollout" else f"rollout_id IN ({rollouts})"
    return conn.execute(
        f"SELECT * FROM {table} WHERE {where} ORDER BY id", {"t": training_id}
    ).fetchall()


def _history(conn, table: str, row_id: int) -> list[tuple]:
    return [
        tuple(r)
        for r in conn.execute(
            "SELECT old_status, new_status, status_message FROM status_history "
            "WHERE entity_type = ? AND entity_id = ? ORDER BY id",
            (table, row_id),
        )
    ]


def _open_count(conn, training_id: int) -> int:
    rollouts = [r for r in _under(conn, training_id, "rollout") if r["status"] in OPEN_ROLLOUT]
    envs = [
        e
        for e in _under(conn, training_id, "environment")
        if e["status"] in ("pending", "creating", "running")
    ]
    return len(rollouts) + len(envs)


# ---------------------------------------------------------------------------- closing


def test_a_terminal_status_closes_that_trainings_open_records_with_history(store):
    mine, other = uid("safe-"), uid("other-")
    store.ingest(_run(mine))
    store.ingest(_run(other))
    store.ingest({"training": {"run_name": mine, "status": "completed"}})
    conn = _db(store)
    t = store.find_id("training", mine)
    rollouts = _under(conn, t, "rollout")
    # Step, eval and baseline rollouts: the open ones cancelled, the finished one left as it was.
    assert [r["status"] for r in rollouts] == ["cancelled", "cancelled", "completed"] * 3
    for r in rollouts:
        if r["status"] == "cancelled":
            assert r["end_time"] is not None
            assert r["status_message"].startswith(
                "closed by the monitor: the training is completed"
            )
            old, new, message = _history(conn, "rollout", r["id"])[-1]
            assert (old in OPEN_ROLLOUT, new, message) == (True, "cancelled", r["status_message"])
    envs = _under(conn, t, "environment")
    assert [e["status"] for e in envs] == ["terminated"] * 9
    closed = [e for e in envs if e["status_message"]]
    assert len(closed) == 6 and all(e["termination_time"] for e in closed)
    assert _history(conn, "environment", closed[0]["id"])[-1][1:] == (
        "terminated",
        closed[0]["status_message"],
    )
    # A completed run leaves its steps, evals and baseline alone (it may hold an untrained step).
    assert conn.execute("SELECT status FROM step WHERE training_id = ?", (t,)).fetchone()[0] == (
        "rollout_running"
    )
    # The other training is untouched.
    assert _open_count(conn, store.find_id("training", other)) == 12


def test_closing_is_idempotent(store):
    name = uid("idem-")
    store.ingest(_run(name))
    store.ingest({"training": {"run_name": name, "status": "cancelled"}})
    conn = _db(store)
    history = conn.execute("SELECT COUNT(*) FROM status_history").fetchone()[0]
    rows = [tuple(r) for r in _under(conn, store.find_id("training", name), "rollout")]
    store.ingest({"training": {"run_name": name, "status": "cancelled"}})
    assert store.reap(None) == {"closed": {}, "reaped": []}
    assert conn.execute("SELECT COUNT(*) FROM status_history").fetchone()[0] == history
    assert [tuple(r) for r in _under(conn, store.find_id("training", name), "rollout")] == rows


def test_a_failed_training_also_ends_its_unfinished_step_eval_and_baseline(store):
    name = uid("fail-")
    store.ingest(_run(name))
    store.ingest(
        {"training": {"run_name": name, "status": "failed", "status_message": "failed",
                      "error_message": "OOM"}}
    )  # fmt: skip
    conn = _db(store)
    t = store.find_id("training", name)
    ends = [
        conn.execute(
            f"SELECT status, status_message FROM {table} WHERE training_id = ?", (t,)
        ).fetchone()
        for table in ("step", "eval", "baseline")
    ]
    assert [e[0] for e in ends] == ["failed", "cancelled", "cancelled"]
    assert all("the training is failed (OOM)" in e[1] for e in ends)
    assert _open_count(conn, t) == 0


def test_a_late_open_rollout_under_an_ended_training_is_kept_and_closed(store):
    """A rollout worker that outlived its trainer still gets its records stored."""
    name = uid("late-")
    store.ingest(_run(name))
    store.ingest({"training": {"run_name": name, "status": "failed"}})
    late = uid("late-r-")
    store.ingest(
        {
            "rollouts": [{"client_id": late, "rollout_id": late,
                          "step_client_id": f"step-{name}-1-0", "task_client_id": "t",
                          "model_path": "m", "status": "running"}],
            "environments": [{"client_id": f"{late}:env", "rollout_client_id": late,
                              "env_type": "sim", "status": "running"}],
            "turns": [{"client_id": f"{late}:turn:1", "rollout_client_id": late, "turn": 1,
                       "model_response": "tap(1, 2)"}],
        }
    )  # fmt: skip
    conn = _db(store)
    rid = store.find_id("rollout", late)
    assert [h[1] for h in _history(conn, "rollout", rid)] == ["running", "cancelled"]
    assert (
        conn.execute("SELECT model_response FROM turn WHERE rollout_id = ?", (rid,)).fetchone()[0]
        == "tap(1, 2)"
    )
    assert _open_count(conn, store.find_id("training", name)) == 0
    # Its final answer is still taken as sent: nothing the worker says is dropped.
    store.ingest({"rollouts": [{"client_id": late, "status": "completed", "reward": 1.0}]})
    assert conn.execute("SELECT status, reward FROM rollout WHERE id = ?", (rid,)).fetchone()[
        :
    ] == (
        "completed",
        1.0,
    )


def test_a_database_written_before_the_safety_net_is_settled_on_the_first_pass(store):
    name = uid("old-")
    store.ingest(_run(name))
    # An ended training with open records, as an older monitor left them.
    with sqlite3.connect(store.path) as raw:
        raw.execute("UPDATE training SET status = 'completed' WHERE run_name = ?", (name,))
    t = store.find_id("training", name)
    assert _open_count(_db(store), t) == 12
    done = store.reap(None)
    assert done["closed"] == {t: {"rollout": 6, "environment": 6}}
    assert _open_count(_db(store), t) == 0


# ---------------------------------------------------------------------------- reaping


def test_a_silent_training_is_failed_and_its_records_closed(store):
    silent, alive = uid("silent-"), uid("alive-")
    store.ingest(_run(silent, beat=T0))
    store.ingest(_run(alive, beat=T0 + timedelta(seconds=950)))
    now = T0 + timedelta(seconds=1000)
    assert store.reap(600, now=T0 + timedelta(seconds=500))["reaped"] == []  # not yet
    (reaped,) = store.reap(600, now=now)["reaped"]
    assert (reaped["run_name"], round(reaped["silent_s"])) == (silent, 1000)
    assert (reaped["rollout"], reaped["environment"], reaped["step"]) == (6, 6, 1)
    conn = _db(store)
    t = conn.execute("SELECT * FROM training WHERE run_name = ?", (silent,)).fetchone()
    assert t["status"] == "failed"
    assert t["status_message"].startswith("heartbeat lost: silent for 1000 s (timeout 600 s)")
    assert t["end_time"] == timestamp(T0)  # the last moment it was known alive
    assert _history(conn, "training", t["id"])[-1] == ("running", "failed", t["status_message"])
    assert _open_count(conn, t["id"]) == 0
    cancelled = [r for r in _under(conn, t["id"], "rollout") if r["status"] == "cancelled"]
    assert all("heartbeat lost" in r["status_message"] for r in cancelled)
    a = store.find_id("training", alive)
    assert conn.execute("SELECT status FROM training WHERE id = ?", (a,)).fetchone()[0] == "running"
    assert _open_count(conn, a) == 12
    assert store.reap(600, now=now)["reaped"] == []  # once only


def test_silence_counts_from_the_monitors_receipt_when_the_trainers_clock_lags(store):
    """``updated_at`` (the monitor's clock) is a sign of life too: a trainer whose clock is an
    hour behind is not reaped while its records keep arriving."""
    name = uid("lag-")
    store.ingest(_run(name, beat=datetime.now(UTC) - timedelta(hours=1)))
    assert store.reap(600)["reaped"] == []
    assert store.reap(600, now=datetime.now(UTC) + timedelta(seconds=700))["reaped"] != []


def test_a_reaped_trainer_that_beats_again_gets_its_training_back(store):
    name = uid("paused-")
    store.ingest(_run(name, beat=T0))
    store.reap(600, now=T0 + timedelta(seconds=1000))
    # A retried batch carrying an older heartbeat is no sign that the trainer came back.
    store.ingest({"training": {"run_name": name, "last_heartbeat": timestamp(T0)}})
    conn = _db(store)
    row = conn.execute("SELECT id, status FROM training WHERE run_name = ?", (name,)).fetchone()
    assert row["status"] == "failed"
    store.ingest(
        {"training": {"run_name": name, "last_heartbeat": timestamp(T0 + timedelta(seconds=1200))}}
    )
    t = conn.execute("SELECT * FROM training WHERE id = ?", (row["id"],)).fetchone()
    assert (t["status"], t["error_message"], t["end_time"]) == ("running", None, None)
    assert t["status_message"].startswith("heartbeat back after 1200 s of silence")
    assert [h[1] for h in _history(conn, "training", t["id"])] == ["running", "failed", "running"]
    # It can be reaped again later, and a trainer-declared end is never undone by a heartbeat.
    assert store.reap(600, now=T0 + timedelta(seconds=3000))["reaped"]
    store.ingest({"training": {"run_name": name, "status": "failed", "error_message": "crash"}})
    store.ingest(
        {"training": {"run_name": name, "last_heartbeat": timestamp(T0 + timedelta(hours=2))}}
    )
    assert conn.execute("SELECT status FROM training WHERE id = ?", (t["id"],)).fetchone()[0] == (
        "failed"
    )


# ---------------------------------------------------------------------------- HTTP


def test_the_server_reaps_at_startup_and_while_it_runs(tmp_path):
    db = tmp_path / "monitor.db"
    name, later = uid("startup-"), uid("running-")
    store = MonitorStore(db)
    # Silent for years by both clocks: the trainer's and the monitor's.
    store.ingest(_run(name, training={"last_heartbeat": LONG_AGO, "updated_at": LONG_AGO}))
    training_id = store.find_id("training", name)
    step_id = store.find_id("step", f"step-{name}-1-0")
    store.close()
    server = MonitorProcess(db, extra_args=("--heartbeat-timeout-s", "60"))
    server.start()
    try:
        with httpx.Client(base_url=server.base_url, headers=server.headers(), timeout=30) as http:
            training = http.get(f"/api/trainings/{training_id}").json()["training"]
            assert training["status"] == "failed"
            assert training["status_message"].startswith("heartbeat lost")
            rollouts = http.get(f"/api/steps/{step_id}/rollouts").json()["rollouts"]
            assert sorted(r["status"] for r in rollouts) == ["cancelled", "cancelled", "completed"]
            # The pass repeats while the server runs (every 6 s at this timeout): a training
            # posted already silent is failed by a later pass, without a restart.
            batch = _run(later, training={"last_heartbeat": LONG_AGO, "updated_at": LONG_AGO})
            assert http.post("/api/ingest/batch", json=batch).status_code == 200
            later_id = http.get("/api/trainings").json()["trainings"][0]["id"]
            status, deadline = None, time.monotonic() + 60
            while status != "failed" and time.monotonic() < deadline:
                status = http.get(f"/api/trainings/{later_id}").json()["training"]["status"]
                time.sleep(0.2)
            assert status == "failed"
            history = http.get(f"/api/status-history/training/{later_id}").json()["history"]
            assert history[-1]["new_status"] == "failed"
    finally:
        server.stop()
    assert "heartbeat silent" in server.log.read_text()


def test_a_terminal_status_posted_over_http_closes_the_open_records(shared_monitor):
    name = uid("http-")
    with httpx.Client(
        base_url=shared_monitor.base_url, headers=shared_monitor.headers(), timeout=30
    ) as http:
        answer = http.post("/api/ingest/batch", json=_run(name)).json()
        ended = {"training": {"run_name": name, "status": "cancelled",
                              "status_message": "interrupted (SIGTERM)"}}  # fmt: skip
        assert http.post("/api/ingest/batch", json=ended).status_code == 200
        for r in answer["rollouts"]:
            rollout = http.get(f"/api/rollouts/{r['id']}").json()["rollout"]
            assert rollout["status"] in ("cancelled", "completed")
            if rollout["status"] == "cancelled":
                assert "interrupted (SIGTERM)" in rollout["status_message"]
        for e in answer["environments"]:
            history = http.get(f"/api/status-history/environment/{e['id']}").json()["history"]
            assert history[-1]["new_status"] == "terminated"


# ---------------------------------------------------------------------------- dashboard


@pytest.fixture
def closed_run(tmp_path):
    """A database holding one training reaped with episodes running under it, served."""
    db = tmp_path / "dash.db"
    store = MonitorStore(db)
    name = uid("reaped-")
    store.ingest(_run(name, beat=T0))
    store.reap(600, now=T0 + timedelta(seconds=900))
    ids = {
        "training": store.find_id("training", name),
        "step": store.find_id("step", f"step-{name}-1-0"),
        "name": name,
    }
    store.close()
    server = MonitorProcess(db, token=None)
    server.start()
    yield server, ids
    server.stop()


def test_the_dashboard_shows_heartbeat_lost_and_no_running_episode(closed_run):
    server, ids = closed_run
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        listing = http.get("/").text
        row = next(r for r in listing.split('<tr class="training-row">') if ids["name"] in r)
        assert re.search(r">failed</span><span class=\"status-note\">: heartbeat lost<", row)
        assert "stale" not in row
        page = http.get(f"/trainings/{ids['training']}").text
        assert ": heartbeat lost</span>" in page
        step_row = page.split('class="step-row" data-step="1"')[1].split("</tr>")[0]
        cells = re.findall(r'<td class="num">([^<]*)</td>', step_row)
        # reward, std, success (the eval's cell is a link), then accepted, rejected, stopped,
        # running: the two episodes that were running are counted stopped.
        assert cells[3:7] == ["1", "0", "2", "0"], cells
        grid = http.get(f"/steps/{ids['step']}").text
        samples = re.findall(r'<a class="sample ([^"]*)"', grid)
        assert len(samples) == 3 and not any("live" in s or "running" in s for s in samples)
