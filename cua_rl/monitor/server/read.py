"""The monitor database's read model: every query that reads it outside ingest lives here.

:class:`MonitorReader` answers what its callers ask, by name: the JSON API's records
(``list_trainings``, ``get_rollout``, ...), the dashboard's tables (``trainings_overview``,
``step_table``, ...), the demo's progress (``latest_training``, ``rollout_counts``, ...), the
learning curve (``completed_steps``) and the benches' figures. Answers are plain dicts (a row per
dict); shaping them for a page stays with the caller (``views``). Ingest keeps the lookups it makes
inside its own write transaction (``store``); nothing else writes SQL against the file.

Connections are read-only (``mode=ro``: a missing file is an error, never created) and one per
thread, as SQLite connections are not shared between threads; ``close`` closes them all.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

from cua_rl.monitor.protocol import SOURCE_ID_COLUMNS, SOURCE_TYPES, STATUSES, TERMINAL

Row = dict[str, Any]
# The training episodes of a run (not its baseline or evals), for ``training.id = ?``.
_TRAINING_ROLLOUT = (
    "r.source_type = 'step' AND r.step_id IN (SELECT id FROM step WHERE training_id = ?)"
)


def read_extras(conn: sqlite3.Connection, table: str, ids: list[int]) -> dict[int, dict]:
    """The kept unknown fields of rows ``ids`` of ``table`` (one query per 500 ids)."""
    found: dict[int, dict] = {}
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        sql = (
            "SELECT entity_id, fields_json FROM extra_field WHERE entity_type = ? "
            f"AND entity_id IN ({', '.join('?' * len(chunk))})"
        )
        for entity_id, fields_json in conn.execute(sql, (table, *chunk)):
            found[entity_id] = json.loads(fields_json)
    return found


class MonitorReader:
    """Named reads of one monitor database file, safe to share between threads."""

    def __init__(self, path: str | Path, *, timeout_s: float = 10.0):
        self.path = Path(path)
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: list[sqlite3.Connection] = []

    def conn(self) -> sqlite3.Connection:
        """This thread's read-only connection (rows as ``sqlite3.Row``)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(
                f"file:{self.path}?mode=ro",
                uri=True,
                timeout=self.timeout_s,
                isolation_level=None,
                check_same_thread=False,
            )
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA query_only = ON")
            self._local.conn = conn
            with self._lock:
                self._open.append(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            for conn in self._open:
                conn.close()
            self._open.clear()
        self._local = threading.local()

    def _rows(self, sql: str, params: tuple | list = ()) -> list[Row]:
        return [dict(r) for r in self.conn().execute(sql, params)]

    def _one(self, sql: str, params: tuple | list = ()) -> Row | None:
        row = self.conn().execute(sql, params).fetchone()
        return dict(row) if row else None

    def extras(self, table: str, ids: list[int]) -> dict[int, dict]:
        return read_extras(self.conn(), table, ids)

    def _with_extras(self, table: str, rows: list[Row]) -> list[Row]:
        found = self.extras(table, [r["id"] for r in rows]) if rows else {}
        for r in rows:
            if r["id"] in found:
                r["extra"] = found[r["id"]]
        return rows

    # ------------------------------------------------------------------ the JSON API

    def list_trainings(self, *, limit: int = 50, before_id: int | None = None) -> list[Row]:
        if before_id is None:
            rows = self._rows("SELECT * FROM training ORDER BY id DESC LIMIT ?", (limit,))
        else:
            rows = self._rows(
                "SELECT * FROM training WHERE id < ? ORDER BY id DESC LIMIT ?", (before_id, limit)
            )
        return self._with_extras("training", rows)

    def get_training(self, training_id: int) -> Row | None:
        rows = self._with_extras(
            "training", self._rows("SELECT * FROM training WHERE id = ?", (training_id,))
        )
        if not rows:
            return None
        training = rows[0]
        for key, table, order in (
            ("steps", "step", "step, id"),
            ("evals", "eval", "step, id"),
            ("baselines", "baseline", "id"),
            ("pauses", "service_pause", "start_time, id"),
        ):
            training[key] = self._with_extras(
                table,
                self._rows(
                    f"SELECT * FROM {table} WHERE training_id = ? ORDER BY {order}", (training_id,)
                ),
            )
        return training

    def list_rollouts(
        self, source_type: str, source_id: int, *, limit: int = 500, after_id: int = 0
    ) -> list[Row] | None:
        if source_type not in SOURCE_ID_COLUMNS:
            raise ValueError(f"source_type must be one of {list(SOURCE_TYPES)}")
        if self._one(f"SELECT id FROM {source_type} WHERE id = ?", (source_id,)) is None:
            return None
        col = SOURCE_ID_COLUMNS[source_type]
        rows = self._rows(
            f"SELECT * FROM rollout WHERE source_type = ? AND {col} = ? AND id > ? "
            "ORDER BY id LIMIT ?",
            (source_type, source_id, after_id, limit),
        )
        return self._with_extras("rollout", rows)

    def get_rollout(self, rollout_id: int) -> Row | None:
        rows = self._with_extras("rollout", self.rollout_rows(rollout_id))
        if not rows:
            return None
        rollout = rows[0]
        turns = self._with_extras("turn", self.turns(rollout_id))
        by_turn = {t["id"]: t for t in turns}
        for t in turns:
            t["actions"], t["observations"] = [], []
        for key, table in (("actions", "action"), ("observations", "obs")):
            for item in self._with_extras(table, self.turn_items(table, rollout_id)):
                by_turn[item["turn_id"]][key].append(item)
        rollout["turns"] = turns
        rollout["validations"] = self._with_extras("validation", self.validations(rollout_id))
        rollout["environments"] = self._with_extras("environment", self.environments(rollout_id))
        rollout["validation"] = rollout["validations"][-1] if rollout["validations"] else None
        rollout["environment"] = rollout["environments"][-1] if rollout["environments"] else None
        return rollout

    def status_history(self, entity_type: str, entity_id: int) -> list[Row]:
        if entity_type not in STATUSES:
            raise ValueError(f"entity_type must be one of {list(STATUSES)}")
        return self._rows(
            "SELECT * FROM status_history WHERE entity_type = ? AND entity_id = ? "
            "ORDER BY changed_at, id",
            (entity_type, entity_id),
        )

    def task_outcomes(self, run_name: str) -> tuple[int | None, list[Row]]:
        """Completed training rollouts of a run, aggregated per task and step (the curriculum's
        outcomes, docs/curriculum.md), with the training's id (``None``: no such run yet)."""
        found = self._one("SELECT id FROM training WHERE run_name = ?", (run_name,))
        if found is None:
            return None, []
        return found["id"], self._rows(
            "SELECT t.task_id AS task_id, s.step AS step, COUNT(*) AS n, "
            "SUM(COALESCE(r.task_success, 0)) AS successes, SUM(r.reward) AS reward_sum, "
            "MIN(r.reward) AS reward_min, MAX(r.reward) AS reward_max "
            "FROM step s JOIN rollout r ON r.source_type = 'step' AND r.step_id = s.id "
            "JOIN task t ON t.id = r.task_id "
            "WHERE s.training_id = ? AND r.status = 'completed' AND r.reward IS NOT NULL "
            "GROUP BY t.task_id, s.step ORDER BY s.step, t.task_id",
            (found["id"],),
        )

    def find_id(self, table: str, client_id: str) -> int | None:
        """The row id recorded for a client id (tests and tools)."""
        row = self._one(
            "SELECT entity_id FROM client_key WHERE entity_type = ? AND client_id = ?",
            (table, client_id),
        )
        return row["entity_id"] if row else None

    # ------------------------------------------------------------------ trainings and steps

    def latest_training(self, run_name: str | None = None) -> Row | None:
        """The newest training (of ``run_name`` when given)."""
        if run_name is None:
            return self._one("SELECT * FROM training ORDER BY id DESC LIMIT 1")
        return self._one(
            "SELECT * FROM training WHERE run_name = ? ORDER BY id DESC LIMIT 1", (run_name,)
        )

    def training(self, training_id: int) -> Row | None:
        return self._one("SELECT * FROM training WHERE id = ?", (training_id,))

    def trainings(self) -> list[Row]:
        """Every training, oldest first: run name, status and error."""
        return self._rows("SELECT run_name, status, error_message FROM training ORDER BY id")

    def trainings_overview(self, limit: int = 200) -> list[Row]:
        """The newest trainings with their last completed step's metrics and last eval."""
        return self._rows(
            "SELECT t.*, "
            "(SELECT metrics_json FROM step s WHERE s.training_id = t.id "
            " AND s.status = 'completed' ORDER BY s.step DESC LIMIT 1) AS last_step_metrics, "
            "(SELECT success_rate FROM eval e WHERE e.training_id = t.id "
            " AND e.success_rate IS NOT NULL ORDER BY e.step DESC LIMIT 1) AS last_eval_success "
            "FROM training t ORDER BY t.id DESC LIMIT ?",
            (limit,),
        )

    def step_table(self, training_id: int) -> list[Row]:
        """The dashboard's columns of every step of a training."""
        return self._rows(
            "SELECT id, step, status, current_phase, reward_mean, reward_std, kl_divergence, "
            "policy_gradient_norm, num_tokens, num_trajectories, loss, learning_rate, "
            "start_time, end_time, rollout_start_time, rollout_end_time, training_start_time, "
            "training_end_time, metrics_json, error_message "
            "FROM step WHERE training_id = ? ORDER BY step, id",
            (training_id,),
        )

    def steps(self, training_id: int) -> list[Row]:
        """Every step of a training (times, status, metrics), in step order."""
        return self._rows(
            "SELECT id, step, start_time, end_time, status, metrics_json FROM step "
            "WHERE training_id = ? ORDER BY step",
            (training_id,),
        )

    def completed_steps(self, training_id: int) -> list[Row]:
        """The committed steps of a training, in order (the learning curve's points)."""
        return self._rows(
            "SELECT step, num_trajectories, end_time, metrics_json FROM step "
            "WHERE training_id = ? AND status = 'completed' ORDER BY step",
            (training_id,),
        )

    def finished_steps(self, training_id: int) -> list[Row]:
        """Completed or failed steps, each with its eval's success rate (``eval_success``)."""
        return self._rows(
            "SELECT s.*, e.success_rate AS eval_success FROM step s LEFT JOIN eval e "
            "ON e.training_id = s.training_id AND e.step = s.step "
            "WHERE s.training_id = ? AND s.status IN ('completed', 'failed') ORDER BY s.step",
            (training_id,),
        )

    def last_step(self, training_id: int) -> Row | None:
        return self._one(
            "SELECT id, step, status, current_phase FROM step WHERE training_id = ? "
            "ORDER BY step DESC LIMIT 1",
            (training_id,),
        )

    def eval_table(self, training_id: int) -> list[Row]:
        return self._rows(
            "SELECT id, step, status, success_rate, avg_reward, avg_turns, start_time, end_time "
            "FROM eval WHERE training_id = ? ORDER BY step, id",
            (training_id,),
        )

    def pause_table(self, training_id: int) -> list[Row]:
        """The training's service pauses, newest first (cua_rl/rollout/service_pauses.py)."""
        return self._rows(
            "SELECT service, reason, error_message, phase, worker, start_time, end_time, "
            "duration_s, probes FROM service_pause WHERE training_id = ? "
            "ORDER BY start_time DESC, id DESC",
            (training_id,),
        )

    def baseline_table(self, training_id: int) -> list[Row]:
        return self._rows(
            "SELECT id, status, success_rate, avg_reward, avg_turns, start_time, end_time, "
            "model_path FROM baseline WHERE training_id = ? ORDER BY id",
            (training_id,),
        )

    def running_pass(self, kind: str, training_id: int) -> Row | None:
        """The newest running baseline or eval of a training (``step`` is None for a baseline)."""
        step = "step" if kind == "eval" else "NULL AS step"
        return self._one(
            f"SELECT id, {step}, current_phase FROM {self._source_table(kind)} "
            "WHERE training_id = ? AND status = 'running' ORDER BY id DESC LIMIT 1",
            (training_id,),
        )

    def table_counts(self, tables: tuple[str, ...]) -> dict[str, int]:
        """Rows per table; a table the file does not have (never migrated) is left out."""
        counts = {}
        for table in tables:
            try:
                counts[table] = self._one(f"SELECT COUNT(*) AS n FROM {table}")["n"]  # noqa: S608
            except sqlite3.Error:
                continue
        return counts

    # ------------------------------------------------------------------ rollouts

    @staticmethod
    def _source_table(kind: str) -> str:
        if kind not in SOURCE_ID_COLUMNS:
            raise ValueError(f"source kind must be one of {list(SOURCE_TYPES)}")
        return kind

    def source(self, kind: str, source_id: int) -> Row | None:
        """A step, eval or baseline row."""
        return self._one(f"SELECT * FROM {self._source_table(kind)} WHERE id = ?", (source_id,))

    def source_brief(self, kind: str, source_id: int) -> Row | None:
        step = "step" if kind != "baseline" else "NULL AS step"
        return self._one(
            f"SELECT id, training_id, {step} FROM {self._source_table(kind)} WHERE id = ?",
            (source_id,),
        )

    def training_brief(self, training_id: int) -> Row | None:
        return self._one("SELECT id, run_name, status FROM training WHERE id = ?", (training_id,))

    def source_rollouts(self, kind: str, source_id: int, limit: int) -> list[Row]:
        """The rollouts of a step, eval or baseline with their task's key and name."""
        col = SOURCE_ID_COLUMNS[self._source_table(kind)]
        return self._rows(
            "SELECT r.id, r.rollout_id, r.status, r.reward, r.num_turns, r.rollout_time, "
            "r.status_message, r.error_message, r.task_success, r.validation_passed, "
            "r.start_time, r.end_time, r.task_id AS task_row, k.task_id AS task_key, "
            "k.name AS task_name FROM rollout r JOIN task k ON k.id = r.task_id "
            f"WHERE r.source_type = ? AND r.{col} = ? ORDER BY r.id LIMIT ?",
            (kind, source_id, limit),
        )

    def step_outcomes(self, training_id: int) -> list[Row]:
        """Training episodes counted per step, status and reason."""
        return self._rows(
            "SELECT r.step_id, r.status, COALESCE(r.status_message, r.error_message) AS reason, "
            f"COUNT(*) AS n FROM rollout r WHERE {_TRAINING_ROLLOUT} "
            "GROUP BY r.step_id, r.status, reason",
            (training_id,),
        )

    def free_reward_counts(self, training_id: int) -> dict[int, dict[str, int]]:
        """Per step id, its training episodes marked rewarded while no action changed the state
        (``free_reward``) or while the gym said nothing of it (``free_reward_unknown``): the
        marks ``cua_rl.audit.live`` keeps in the rollout's extra fields."""
        rows = self._rows(
            "SELECT r.step_id, "
            "SUM(COALESCE(json_extract(x.fields_json, '$.free_reward'), 0)) AS free, "
            "SUM(COALESCE(json_extract(x.fields_json, '$.free_reward_unknown'), 0)) AS unknown "
            "FROM rollout r LEFT JOIN extra_field x "
            "ON x.entity_type = 'rollout' AND x.entity_id = r.id "
            f"WHERE {_TRAINING_ROLLOUT} GROUP BY r.step_id",
            (training_id,),
        )
        return {
            r["step_id"]: {"free_reward": int(r["free"]), "free_reward_unknown": int(r["unknown"])}
            for r in rows
        }

    def rollout_counts(self, kind: str, source_id: int) -> dict[str, int]:
        """Rollouts of a step, eval or baseline per status."""
        col = SOURCE_ID_COLUMNS[self._source_table(kind)]
        rows = self._rows(
            f"SELECT status, COUNT(*) AS n FROM rollout WHERE {col} = ? GROUP BY status",
            (source_id,),
        )
        return {r["status"]: r["n"] for r in rows}

    def last_completed_rollout(self, kind: str, source_id: int) -> Row | None:
        col = SOURCE_ID_COLUMNS[self._source_table(kind)]
        return self._one(
            f"SELECT reward, task_success FROM rollout WHERE {col} = ? "
            "AND status = 'completed' ORDER BY end_time DESC, id DESC LIMIT 1",
            (source_id,),
        )

    def training_rollout_ends(self, training_id: int) -> list[Row]:
        """Status and end time of every training episode of a training."""
        return self._rows(
            f"SELECT r.status, r.end_time FROM rollout r WHERE {_TRAINING_ROLLOUT}",
            (training_id,),
        )

    def first_rollout_start(self, training_id: int) -> str | None:
        return self._one(
            f"SELECT MIN(r.start_time) AS t FROM rollout r WHERE {_TRAINING_ROLLOUT}",
            (training_id,),
        )["t"]

    def training_rollouts_with_environment(self, training_id: int) -> list[Row]:
        """Training episodes with their environment's creation and termination times."""
        return self._rows(
            "SELECT r.id, r.status, r.error_message, r.end_time, e.creation_time, "
            "e.termination_time FROM rollout r LEFT JOIN environment e ON e.rollout_id = r.id "
            f"WHERE {_TRAINING_ROLLOUT}",
            (training_id,),
        )

    def training_turn_times(self, training_id: int) -> list[Row]:
        """Start and end of every turn of the training episodes of a training."""
        return self._rows(
            "SELECT t.rollout_id, t.start_time, t.end_time FROM turn t JOIN rollout r "
            f"ON r.id = t.rollout_id WHERE {_TRAINING_ROLLOUT}",
            (training_id,),
        )

    def training_rollout_outcomes(self, training_id: int) -> list[Row]:
        """Every training episode's client id, status, reason (``status_message``) and end."""
        return self._rows(
            "SELECT r.rollout_id, r.status, r.status_message, r.end_time FROM rollout r "
            f"WHERE {_TRAINING_ROLLOUT}",
            (training_id,),
        )

    def record_integrity(self) -> dict[str, int]:
        """Over the whole file: environments not in a final status, environments that name a
        gym box, and records stored twice (bench/soak.py's open, lost and duplicated records).
        Turns and rollouts are unique by schema; a replayed batch could still add a second
        identical action or observation to a turn, a second environment or validation to a
        rollout."""
        final = ", ".join(f"'{s}'" for s in sorted(TERMINAL["environment"]))
        twice = {
            "duplicate_actions": "action GROUP BY turn_id, action_type, tool_name, tool_args, "
            "tokens",
            "duplicate_observations": "obs GROUP BY turn_id, obs_type, screenshot_uri, "
            "text_content",
            "duplicate_environments": "environment GROUP BY rollout_id",
            "duplicate_validations": "validation GROUP BY rollout_id",
        }
        out = {
            "open_environments": self._one(
                f"SELECT COUNT(*) AS n FROM environment WHERE status NOT IN ({final})"  # noqa: S608
            )["n"],
            "boxes": self._one("SELECT COUNT(*) AS n FROM environment WHERE gbox_id IS NOT NULL")[
                "n"
            ],
        }
        for name, grouped in twice.items():
            out[name] = self._one(
                "SELECT COALESCE(SUM(n - 1), 0) AS n FROM "  # noqa: S608 - fixed names
                f"(SELECT COUNT(*) AS n FROM {grouped} HAVING n > 1)"
            )["n"]
        return out

    # ------------------------------------------------------------------ one rollout

    def rollout_rows(self, rollout_id: int) -> list[Row]:
        return self._rows("SELECT * FROM rollout WHERE id = ?", (rollout_id,))

    def task_brief(self, task_row: int) -> Row | None:
        return self._one(
            "SELECT id, task_id, name, description FROM task WHERE id = ?", (task_row,)
        )

    def stored_episode(self, rollout_id: int) -> Row | None:
        """The rollout's episode in the trajectory warehouse (``id``, ``n_rows``), if stored
        (None too for a database before the warehouse's migration)."""
        if not self._one("SELECT 1 AS x FROM sqlite_master WHERE name = 'episode_store'"):
            return None
        return self._one("SELECT id, n_rows FROM episode_store WHERE rollout_id = ?", (rollout_id,))

    def turns(self, rollout_id: int) -> list[Row]:
        return self._rows(
            "SELECT * FROM turn WHERE rollout_id = ? ORDER BY turn, id", (rollout_id,)
        )

    def turn_items(self, table: str, rollout_id: int) -> list[Row]:
        """The actions (``action``) or observations (``obs``) of a rollout's turns."""
        if table not in ("action", "obs"):
            raise ValueError("turn items are 'action' or 'obs'")
        return self._rows(
            f"SELECT x.* FROM {table} x JOIN turn t ON x.turn_id = t.id "
            "WHERE t.rollout_id = ? ORDER BY x.id",
            (rollout_id,),
        )

    def validations(self, rollout_id: int) -> list[Row]:
        return self._rows(
            "SELECT * FROM validation WHERE rollout_id = ? ORDER BY id", (rollout_id,)
        )

    def environments(self, rollout_id: int) -> list[Row]:
        return self._rows(
            "SELECT * FROM environment WHERE rollout_id = ? ORDER BY id", (rollout_id,)
        )

    def stored_screenshots(self, digests: list[str]) -> set[str]:
        """Which of these image hashes the screenshot store holds."""
        stored: set[str] = set()
        for start in range(0, len(digests), 500):
            chunk = digests[start : start + 500]
            stored.update(
                r[0]
                for r in self.conn().execute(
                    f"SELECT sha256 FROM screenshot WHERE sha256 IN ({', '.join('?' * len(chunk))})",
                    chunk,
                )
            )
        return stored

    def screenshot_totals(self) -> dict[str, int]:
        """How many images the screenshot store holds and their bytes."""
        return self._one(
            "SELECT COUNT(*) AS images, COALESCE(SUM(bytes), 0) AS bytes FROM screenshot"
        )

    def status_changes(self, entity_type: str, entity_id: int) -> list[Row]:
        """The dashboard's columns of a record's status history, oldest first."""
        return self._rows(
            "SELECT id, old_status, new_status, progress_percent, status_message, changed_at "
            "FROM status_history WHERE entity_type = ? AND entity_id = ? "
            "ORDER BY changed_at, id",
            (entity_type, entity_id),
        )
