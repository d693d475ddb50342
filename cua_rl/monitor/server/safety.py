"""The monitor's safety net: nothing stays open under a training that has ended.

A run should close every episode it started, but a process killed outright (SIGKILL, out of
memory, a scheduler's grace period run out) cannot. The monitor therefore enforces two rules
itself, inside its own write transactions:

- **Closing.** Whenever a training is in a terminal status (completed, failed, cancelled), its
  rollouts still open are set ``cancelled`` and its environments still open ``terminated``, each
  with a status message naming why (the status_history triggers keep it). Records under its
  steps, evals and baseline are all covered. A failed or cancelled training also fails its
  unfinished steps and cancels its unfinished evals and baseline. This runs in the transaction
  that made the training terminal, and again for any open rollout or environment a later batch
  writes under it, so it is atomic and idempotent (closed records are not touched again).
- **Reaping.** A training still active whose last sign of life is older than the heartbeat
  timeout is set ``failed`` ("heartbeat lost: ...") and its records closed as above. The last
  sign of life is the later of ``last_heartbeat`` (the trainer's clock) and ``updated_at`` (the
  monitor's clock when any record of the training last arrived), so a trainer clock behind the
  monitor's cannot get a live training reaped.

A reaped trainer that was only paused (stopped, cut off) and sends a heartbeat again is taken
back: the training returns to the status it had, with a message saying how long it was silent.
Nothing is dropped meanwhile: late records are stored as sent, and an open rollout a late batch
writes under a training still terminal is closed again at once.
"""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime

from cua_rl.monitor.protocol import STATUSES, TERMINAL
from cua_rl.monitor.server.batch import drop_extra, merge_extras
from cua_rl.monitor.server.views import HEARTBEAT_LOST, parse_time

# The trainer refreshes its heartbeat every 30 s; 20 missed beats is no hiccup.
DEFAULT_HEARTBEAT_TIMEOUT_S = 600.0
# The extra field a reaped training carries until its trainer comes back.
REAPED = "monitor_reaped"

_FMT = "%Y-%m-%d %H:%M:%S.%f"


def _open(table: str) -> tuple[str, ...]:
    return tuple(s for s in STATUSES[table] if s not in TERMINAL[table])


def _words(values) -> str:
    return ", ".join(f"'{v}'" for v in values)


OPEN_ROLLOUT = _open("rollout")
OPEN_ENVIRONMENT = _open("environment")
ACTIVE_TRAINING = _open("training")
_TERMINAL_TRAINING = _words(sorted(TERMINAL["training"]))
# The training a rollout ``r`` belongs to, whichever its source.
_TRAINING_OF_ROLLOUT = (
    "CASE r.source_type "
    "WHEN 'step' THEN (SELECT training_id FROM step WHERE id = r.step_id) "
    "WHEN 'eval' THEN (SELECT training_id FROM eval WHERE id = r.eval_id) "
    "ELSE (SELECT training_id FROM baseline WHERE id = r.baseline_id) END"
)
# How an open record under an ended training is closed: its end status, the column of its end
# time, and the column that names its rollout.
_CLOSE = {
    "rollout": ("cancelled", "end_time", "id", OPEN_ROLLOUT),
    "environment": ("terminated", "termination_time", "rollout_id", OPEN_ENVIRONMENT),
}
# What an open source record becomes when its training failed or was cancelled.
_SOURCE_END = {"step": "failed", "eval": "cancelled", "baseline": "cancelled"}


def timestamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime(_FMT)


def close_open_records(
    conn: sqlite3.Connection, training_id: int, why: str, now: datetime
) -> dict[str, int]:
    """Close what is still open under one training (inside the caller's transaction).

    Returns how many rows of each table changed; a second call changes none."""
    row = conn.execute("SELECT status FROM training WHERE id = ?", (training_id,)).fetchone()
    if row is None or row[0] not in TERMINAL["training"]:
        return {}
    status = row[0]
    message = f"closed by the monitor: the training is {status} ({why})"
    at = timestamp(now)
    closed = {"rollout": 0, "environment": 0}
    for kind, column in (("step", "step_id"), ("eval", "eval_id"), ("baseline", "baseline_id")):
        rollouts = (
            f"SELECT id FROM rollout WHERE source_type = '{kind}' AND {column} IN "
            f"(SELECT id FROM {kind} WHERE training_id = ?)"
        )
        for table, (end, time_column, link, words) in _CLOSE.items():
            closed[table] += conn.execute(
                f"UPDATE {table} SET status = ?, status_message = ?, "
                f"{time_column} = COALESCE({time_column}, ?) "
                f"WHERE status IN ({_words(words)}) AND {link} IN ({rollouts})",
                (end, message, at, training_id),
            ).rowcount
    if status != "completed":
        # A completed run may have recorded a step it never trained (a prefetched batch): only
        # a run that failed or was cancelled ends its unfinished steps, evals and baseline.
        for table, end in _SOURCE_END.items():
            closed[table] = conn.execute(
                f"UPDATE {table} SET status = ?, status_message = ?, "
                "end_time = COALESCE(end_time, ?) "
                f"WHERE training_id = ? AND status IN ({_words(_open(table))})",
                (end, message, at, training_id),
            ).rowcount
    return closed


def _why(conn: sqlite3.Connection, training_id: int) -> str:
    row = conn.execute(
        "SELECT status, status_message, error_message FROM training WHERE id = ?", (training_id,)
    ).fetchone()
    if row is None:
        return "no reason given"
    # A failure's error says why (train.py's status message is only "failed"); a cancel's
    # status message names the signal.
    first, second = (row[2], row[1]) if row[0] == "failed" else (row[1], row[2])
    return (first or second or "no reason given")[:300]


def close_under_ended(conn: sqlite3.Connection, training_ids, now: datetime) -> dict[int, dict]:
    """``close_open_records`` for each of ``training_ids`` that is terminal."""
    done = {}
    for training_id in sorted(set(training_ids)):
        closed = close_open_records(conn, training_id, _why(conn, training_id), now)
        if any(closed.values()):
            done[training_id] = closed
    return done


def ended_owners(
    conn: sqlite3.Connection, rollout_ids: list[int], environment_ids: list[int]
) -> set[int]:
    """Terminal trainings that own an open rollout or environment among the given ids."""
    owners: set[int] = set()
    queries = (
        (
            rollout_ids,
            f"SELECT DISTINCT {_TRAINING_OF_ROLLOUT} FROM rollout r "
            f"WHERE r.status IN ({_words(OPEN_ROLLOUT)}) AND r.id IN ({{ids}})",
        ),
        (
            environment_ids,
            f"SELECT DISTINCT {_TRAINING_OF_ROLLOUT} FROM environment e "
            "JOIN rollout r ON r.id = e.rollout_id "
            f"WHERE e.status IN ({_words(OPEN_ENVIRONMENT)}) AND e.id IN ({{ids}})",
        ),
    )
    for ids, sql in queries:
        ids = [i for i in ids if isinstance(i, int)]
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            rows = conn.execute(sql.format(ids=", ".join("?" * len(chunk))), chunk)
            owners.update(r[0] for r in rows if r[0] is not None)
    return ended_owners_of(conn, sorted(owners))


def all_ended_owners(conn: sqlite3.Connection) -> set[int]:
    """Every terminal training with an open rollout or environment (a database written before
    the safety net, or by a batch that bypassed it)."""
    rows = conn.execute(
        f"SELECT DISTINCT {_TRAINING_OF_ROLLOUT} FROM rollout r "
        f"WHERE r.status IN ({_words(OPEN_ROLLOUT)}) "
        f"UNION SELECT DISTINCT {_TRAINING_OF_ROLLOUT} FROM environment e "
        "JOIN rollout r ON r.id = e.rollout_id "
        f"WHERE e.status IN ({_words(OPEN_ENVIRONMENT)})"
    ).fetchall()
    return ended_owners_of(conn, [r[0] for r in rows if r[0] is not None])


def ended_owners_of(conn: sqlite3.Connection, training_ids: list[int]) -> set[int]:
    """The terminal ones among ``training_ids``."""
    found: set[int] = set()
    for start in range(0, len(training_ids), 500):
        chunk = training_ids[start : start + 500]
        rows = conn.execute(
            f"SELECT id FROM training WHERE id IN ({', '.join('?' * len(chunk))}) "
            f"AND status IN ({_TERMINAL_TRAINING})",
            chunk,
        )
        found.update(r[0] for r in rows)
    return found


# ---------------------------------------------------------------------------- reaping


def _last_sign(heartbeat, updated_at) -> datetime | None:
    times = [t for t in (parse_time(heartbeat), parse_time(updated_at)) if t is not None]
    return max(times) if times else None


def reap_silent(conn: sqlite3.Connection, timeout_s: float, now: datetime) -> list[dict]:
    """Fail every active training silent for more than ``timeout_s`` and close its records
    (inside the caller's transaction); returns what was reaped."""
    rows = conn.execute(
        "SELECT id, run_name, status, last_heartbeat, updated_at, created_at FROM training "
        f"WHERE status IN ({_words(ACTIVE_TRAINING)})"
    ).fetchall()
    reaped = []
    for row in rows:
        last = _last_sign(row["last_heartbeat"], row["updated_at"]) or parse_time(row["created_at"])
        if last is None:
            continue
        silent = (now - last).total_seconds()
        if silent <= timeout_s:
            continue
        message = (
            f"{HEARTBEAT_LOST}: silent for {silent:.0f} s (timeout {timeout_s:.0f} s), "
            "trainer presumed dead"
        )
        conn.execute(
            "UPDATE training SET status = 'failed', status_message = ?, error_message = ?, "
            "end_time = COALESCE(end_time, ?) WHERE id = ?",
            (message, message, timestamp(last), row["id"]),
        )
        merge_extras(
            conn,
            "training",
            row["id"],
            {REAPED: {"at": timestamp(now), "previous_status": row["status"],
                      "last_sign": timestamp(last)}},
        )  # fmt: skip
        closed = close_open_records(conn, row["id"], message, now)
        reaped.append({"id": row["id"], "run_name": row["run_name"], "silent_s": silent, **closed})
    return reaped


def revive_if_back(conn: sqlite3.Connection, training_id: int, record: dict) -> bool:
    """A heartbeat newer than the reaping from a reaped training's trainer: it lives after
    all, so the training gets back the status it had (inside the ingest transaction)."""
    if "status" in record:
        # The trainer says itself where it stands: a later heartbeat revives nothing.
        drop_extra(conn, "training", training_id, REAPED)
        return False
    beat = parse_time(record.get("last_heartbeat"))
    if beat is None:
        return False
    row = conn.execute(
        "SELECT t.status, x.fields_json FROM training t JOIN extra_field x "
        "ON x.entity_type = 'training' AND x.entity_id = t.id WHERE t.id = ?",
        (training_id,),
    ).fetchone()
    if row is None or row[0] != "failed":
        return False
    mark = json.loads(row[1]).get(REAPED)
    last = parse_time(mark.get("last_sign")) if isinstance(mark, dict) else None
    if last is None or beat <= last:
        return False
    previous = mark.get("previous_status")
    if previous not in ACTIVE_TRAINING:
        previous = "running"
    conn.execute(
        "UPDATE training SET status = ?, status_message = ?, error_message = NULL, "
        "end_time = NULL WHERE id = ?",
        (
            previous,
            f"heartbeat back after {(beat - last).total_seconds():.0f} s of silence; the "
            f"monitor had marked the training failed at {mark.get('at')}",
            training_id,
        ),
    )
    drop_extra(conn, "training", training_id, REAPED)
    return True
