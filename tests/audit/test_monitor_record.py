"""The monitor's audit records: ingest (idempotent updates, refusals naming the field) and reads."""

from __future__ import annotations

import pytest

from cua_rl.monitor.server import audits
from cua_rl.monitor.server.migrations import connect
from cua_rl.monitor.server.store import IngestValidationError, MonitorStore


def _audit(**overrides) -> dict:
    return {
        "client_id": "audit-a",
        "status": "running",
        "gym_id": "sim",
        "tasks_total": 2,
        **overrides,
    }


def _task(task_id: str, verdict: str, **overrides) -> dict:
    return {
        "audit_client_id": "audit-a",
        "task_id": task_id,
        "name": task_id,
        "verdict": verdict,
        "flags": [{"kind": verdict, "agent": "stop", "message": "m"}] if verdict != "clean" else [],
        "summary": {"stop": {"runs": 3, "rewarded": 3 if verdict != "clean" else 0, "errors": 0}},
        "skipped": {},
        "runs": [],
        "seconds": 1.5,
        **overrides,
    }


@pytest.fixture
def store(tmp_path):
    s = MonitorStore(tmp_path / "monitor.db")
    yield s
    s.close()


def test_an_audit_is_updated_in_place_and_its_tasks_read_flagged_first(store):
    store.ingest({"audits": [_audit()]})
    store.ingest({"audit_tasks": [_task("t-clean", "clean"), _task("t-free", "free_reward")]})
    # The same task sent again (a spool replay) replaces its row; the audit ends.
    store.ingest({"audit_tasks": [_task("t-free", "free_reward", seconds=2.0)]})
    store.ingest(
        {"audits": [_audit(status="completed", tasks_done=2, flagged=1, counts={"clean": 1})]}
    )
    conn = connect(store.path, read_only=True)
    try:
        (row,) = audits.list_audits(conn)
        assert (row["status"], row["tasks_done"], row["flagged"], row["gym_id"]) == (
            "completed",
            2,
            1,
            "sim",
        )
        assert row["counts"] == {"clean": 1}
        one = audits.get_audit(conn, row["id"])
        assert [(t["task_id"], t["seconds"]) for t in one["tasks"]] == [
            ("t-free", 2.0),
            ("t-clean", 1.5),
        ]
        assert one["tasks"][0]["flags"][0]["agent"] == "stop"
        audit, flagged = audits.flagged_tasks(conn, "sim")
        assert audit["client_id"] == "audit-a"
        assert flagged == [{"task_id": "t-free", "verdict": "free_reward"}]
        assert audits.flagged_tasks(conn, "other") == (None, [])
    finally:
        conn.close()


def test_a_running_audit_is_not_one_a_training_reads(store):
    store.ingest({"audits": [_audit()], "audit_tasks": [_task("t", "flaky")]})
    conn = connect(store.path, read_only=True)
    try:
        assert audits.flagged_tasks(conn, "sim") == (None, [])
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("batch", "kind", "field"),
    [
        ({"audits": [_audit(status="done")]}, "audits", "status"),
        ({"audits": [_audit(colour="red")]}, "audits", "colour"),
        ({"audits": [_audit(tasks_total=-1)]}, "audits", "tasks_total"),
        ({"audits": [_audit(counts=[1])]}, "audits", "counts"),
        ({"audits": [{"status": "running"}]}, "audits", "client_id"),
        ({"audits": [_audit()], "audit_tasks": [_task("t", "fine")]}, "audit_tasks", "verdict"),
        (
            {"audit_tasks": [_task("t", "clean", audit_client_id="nope")]},
            "audit_tasks",
            "audit_client_id",
        ),
        (
            {"audits": [_audit()], "audit_tasks": [_task("t", "clean", runs={})]},
            "audit_tasks",
            "runs",
        ),
    ],
)
def test_a_malformed_record_is_refused_naming_its_field_and_nothing_is_written(
    store, batch, kind, field
):
    with pytest.raises(IngestValidationError) as err:
        store.ingest(batch)
    assert err.value.details()["kind"] == kind
    assert err.value.details()["field"] == field
    conn = connect(store.path, read_only=True)
    try:
        assert audits.list_audits(conn) == []
    finally:
        conn.close()
