"""The monitor's side of verifier audits (``cua_rl.audit``): their records in, and out again.

An audit sends ``audits`` records (its header: gym, status, progress, counts; the same client id
each time, so each record updates the row with the fields it carries) and one ``audit_tasks``
record per audited task (its verdict, flags with evidence, rewarded runs per agent and every run),
which names its audit by ``audit_client_id``. Both are applied in the batch's transaction after
every other kind; a malformed record is refused as the record at its index, and the client drops
that one and counts it. The reads answer the API (``/api/audits``), the dashboard's pages and a
training that leaves out the tasks its gym's newest audit flagged (``curriculum.skip_flagged``).
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from cua_rl.monitor.protocol import (
    AUDIT_FLAGS,
    AUDIT_KIND,
    AUDIT_STATUSES,
    AUDIT_TASK_KIND,
    AUDIT_VERDICTS,
)
from cua_rl.monitor.server.batch import IngestValidationError

_TEXT = ("gym_base_url", "gym_id", "config_path", "message", "started_at", "finished_at")
_COUNTS = ("tasks_total", "tasks_done", "flagged")
_OBJECTS = {"counts": "counts_json", "settings": "settings_json", "executions": "executions_json"}
_AUDIT_FIELDS = {"client_id", "status", *_TEXT, *_COUNTS, *_OBJECTS}
_TASK_OBJECTS = {
    "flags": ("flags_json", list),
    "summary": ("summary_json", dict),
    "skipped": ("skipped_json", dict),
    "runs": ("runs_json", list),
}
_TASK_FIELDS = {"audit_client_id", "task_id", "name", "verdict", "seconds", *_TASK_OBJECTS}


def _refuse(kind: str, index: int, field: str, message: str) -> IngestValidationError:
    return IngestValidationError(message, kind=kind, index=index, field=field)


def _records(batch: dict, kind: str) -> list:
    records = batch.get(kind)
    if records is None:
        return []
    if not isinstance(records, list):
        raise IngestValidationError("must be an array of objects", kind=kind)
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise IngestValidationError("must be an object", kind=kind, index=index)
    return records


def _known(record: dict, allowed: set[str], kind: str, index: int) -> None:
    unknown = sorted(set(record) - allowed)
    if unknown:
        raise _refuse(
            kind, index, unknown[0], f"unknown field; an {kind} record has {sorted(allowed)}"
        )


def apply_audits(conn: sqlite3.Connection, batch: dict) -> dict[str, list[dict]]:
    """Apply a batch's ``audits`` then ``audit_tasks`` records; their ``{client_id, id}``."""
    out: dict[str, list[dict]] = {}
    audits = _records(batch, AUDIT_KIND)
    if audits:
        out[AUDIT_KIND] = [_upsert_audit(conn, r, i) for i, r in enumerate(audits)]
    tasks = _records(batch, AUDIT_TASK_KIND)
    if tasks:
        out[AUDIT_TASK_KIND] = [_upsert_task(conn, r, i) for i, r in enumerate(tasks)]
    return out


def _upsert_audit(conn: sqlite3.Connection, record: dict, index: int) -> dict:
    _known(record, _AUDIT_FIELDS, AUDIT_KIND, index)
    cid = record.get("client_id")
    if not isinstance(cid, str) or not cid:
        raise _refuse(AUDIT_KIND, index, "client_id", "a non-empty string is required")
    values: dict[str, Any] = {}
    if "status" in record:
        if record["status"] not in AUDIT_STATUSES:
            raise _refuse(AUDIT_KIND, index, "status", f"must be one of {list(AUDIT_STATUSES)}")
        values["status"] = record["status"]
    for name in _TEXT:
        if name in record:
            if not isinstance(record[name], str):
                raise _refuse(AUDIT_KIND, index, name, "must be a string")
            values[name] = record[name]
    for name in _COUNTS:
        if name in record:
            v = record[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise _refuse(AUDIT_KIND, index, name, "must be a non-negative integer")
            values[name] = v
    for name, column in _OBJECTS.items():
        if name in record:
            if not isinstance(record[name], dict):
                raise _refuse(AUDIT_KIND, index, name, "must be an object")
            values[column] = json.dumps(record[name], separators=(",", ":"))
    row = conn.execute("SELECT id FROM audit WHERE client_id = ?", (cid,)).fetchone()
    if row is None:
        columns = ["client_id", *values]
        conn.execute(
            f"INSERT INTO audit ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
            [cid, *values.values()],
        )
        row = conn.execute("SELECT id FROM audit WHERE client_id = ?", (cid,)).fetchone()
    elif values:
        sets = ", ".join(f"{c} = ?" for c in values)
        conn.execute(f"UPDATE audit SET {sets} WHERE id = ?", [*values.values(), row[0]])
    return {"client_id": cid, "id": row[0]}


def _upsert_task(conn: sqlite3.Connection, record: dict, index: int) -> dict:
    kind = AUDIT_TASK_KIND
    _known(record, _TASK_FIELDS, kind, index)
    audit_cid = record.get("audit_client_id")
    found = (
        conn.execute("SELECT id FROM audit WHERE client_id = ?", (audit_cid,)).fetchone()
        if isinstance(audit_cid, str)
        else None
    )
    if found is None:
        raise _refuse(kind, index, "audit_client_id", f"no audit {audit_cid!r}; send it first")
    task_id = record.get("task_id")
    if not isinstance(task_id, str) or not task_id:
        raise _refuse(kind, index, "task_id", "a non-empty string is required")
    if record.get("verdict") not in AUDIT_VERDICTS:
        raise _refuse(kind, index, "verdict", f"must be one of {list(AUDIT_VERDICTS)}")
    values: dict[str, Any] = {"name": str(record.get("name") or ""), "verdict": record["verdict"]}
    seconds = record.get("seconds")
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise _refuse(kind, index, "seconds", "must be a number")
        values["seconds"] = float(seconds)
    for name, (column, typ) in _TASK_OBJECTS.items():
        if name in record:
            if not isinstance(record[name], typ):
                raise _refuse(
                    kind, index, name, f"must be a{'n object' if typ is dict else ' list'}"
                )
            values[column] = json.dumps(record[name], separators=(",", ":"))
    columns = ["audit_id", "task_id", *values]
    updates = ", ".join(f"{c} = excluded.{c}" for c in values)
    conn.execute(
        f"INSERT INTO audit_task ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
        f"ON CONFLICT (audit_id, task_id) DO UPDATE SET {updates}",
        [found[0], task_id, *values.values()],
    )
    row = conn.execute(
        "SELECT id FROM audit_task WHERE audit_id = ? AND task_id = ?", (found[0], task_id)
    ).fetchone()
    return {"client_id": f"{audit_cid}:{task_id}", "id": row[0]}


# ---------------------------------------------------------------------------- reads

_AUDIT_COLUMNS = (
    "id, client_id, status, gym_base_url, gym_id, config_path, tasks_total, tasks_done, flagged, "
    "counts_json, settings_json, executions_json, message, started_at, finished_at, created_at, "
    "updated_at"
)


def _decode(row: dict, columns: tuple[str, ...]) -> dict:
    for column in columns:
        raw = row.pop(column, None)
        row[column.removesuffix("_json")] = json.loads(raw) if raw else None
    return row


def _audit_row(row: sqlite3.Row | None) -> dict | None:
    if row is None:
        return None
    return _decode(dict(row), ("counts_json", "settings_json", "executions_json"))


def has_audits(conn: sqlite3.Connection) -> bool:
    return (
        conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'audit'"
        ).fetchone()
        is not None
    )


def list_audits(conn: sqlite3.Connection, *, gym_id: str = "", limit: int = 50) -> list[dict]:
    """Audits, newest first (of one gym when ``gym_id`` is given)."""
    if not has_audits(conn):
        return []
    where, args = ("WHERE gym_id = ?", [gym_id]) if gym_id else ("", [])
    rows = conn.execute(
        f"SELECT {_AUDIT_COLUMNS} FROM audit {where} ORDER BY id DESC LIMIT ?", [*args, limit]
    ).fetchall()
    return [_audit_row(r) for r in rows]


def get_audit(conn: sqlite3.Connection, audit_id: int, *, runs: bool = True) -> dict | None:
    """One audit with its tasks (flagged first, then by task id); ``runs`` adds every run."""
    if not has_audits(conn):
        return None
    audit = _audit_row(
        conn.execute(f"SELECT {_AUDIT_COLUMNS} FROM audit WHERE id = ?", (audit_id,)).fetchone()
    )
    if audit is None:
        return None
    run_column = ", runs_json" if runs else ""
    rows = conn.execute(
        "SELECT id, task_id, name, verdict, flags_json, summary_json, skipped_json, seconds"
        f"{run_column} FROM audit_task WHERE audit_id = ? ORDER BY task_id",
        (audit_id,),
    ).fetchall()
    columns = ("flags_json", "summary_json", "skipped_json", *(("runs_json",) if runs else ()))
    tasks = [_decode(dict(r), columns) for r in rows]
    rank = {v: i for i, v in enumerate(AUDIT_VERDICTS)}
    tasks.sort(key=lambda t: rank.get(t["verdict"], len(rank)))
    audit["tasks"] = tasks
    return audit


def flagged_tasks(conn: sqlite3.Connection, gym_id: str) -> tuple[dict | None, list[dict]]:
    """The newest completed audit of ``gym_id`` and its flagged tasks (task_id, verdict)."""
    if not has_audits(conn):
        return None, []
    audit = _audit_row(
        conn.execute(
            f"SELECT {_AUDIT_COLUMNS} FROM audit WHERE gym_id = ? AND status = 'completed' "
            "ORDER BY id DESC LIMIT 1",
            (gym_id,),
        ).fetchone()
    )
    if audit is None:
        return None, []
    marks = ", ".join("?" * len(AUDIT_FLAGS))
    rows = conn.execute(
        f"SELECT task_id, verdict FROM audit_task WHERE audit_id = ? AND verdict IN ({marks}) "
        "ORDER BY task_id",
        (audit["id"], *AUDIT_FLAGS),
    ).fetchall()
    return audit, [dict(r) for r in rows]
