"""The monitor's storage: atomic, idempotent batch ingest and the dashboard's reads (no HTTP).

``ingest(batch)`` writes one batch in one transaction: records are applied in dependency order
(training, tasks, validators, steps, baselines, evals, rollouts, environments, turns, actions,
observations, validations), so a record may reference one sent earlier in the same batch. Any bad
record rolls the whole batch back and raises :class:`IngestValidationError` naming the array,
the record's index and the field.

Idempotency: every row gets a client id (sent, or derived: the formats of docs/design.md for entities
that have a natural key, a content hash plus occurrence number for actions, observations,
validations, validators and baselines sent without one). ``client_key`` maps it to the row id;
a record whose client id is known updates only the fields it carries.

References: ``<x>_id`` given as an integer is a server id (checked to exist); given as a string,
or as ``<x>_client_id``, it is the referenced record's client id, resolved here. Fields the
schema does not name are kept in ``extra_field`` and returned as ``extra`` by the reads.

The existing clients' dialect (cua_rl/monitor/server/compat.py) is read here too: a training created
without ``log_path`` / ``model_name`` or updated by ``training_id``, their status words, field
aliases, and a rollout that names its environment by ``env_id`` (linked on write).

Speed: client ids of a kind are looked up in one query per 500, and consecutive new records of
one kind with the same columns are inserted with one ``executemany`` (undone to a savepoint and
redone one by one if any of them fails, so errors still name the record).
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlite_utils

from cua_rl.errors import CuaRlError
from cua_rl.monitor.server import compat
from cua_rl.monitor.server.migrations import connect, migrate
from cua_rl.monitor.server.schema import SOURCE_TYPES, STATUSES


class IngestValidationError(CuaRlError, ValueError):
    """A batch was refused; ``kind``/``index``/``field`` locate the offending record."""

    def __init__(
        self,
        message: str,
        *,
        kind: str | None = None,
        index: int | None = None,
        field: str | None = None,
    ):
        where = ""
        if kind is not None:
            where = f"{kind}[{index}]" if index is not None else kind
            if field:
                where += f".{field}"
            where += ": "
        super().__init__(where + message)
        self.kind = kind
        self.index = index
        self.field = field
        self.reason = message

    def details(self) -> dict[str, Any]:
        return {"kind": self.kind, "index": self.index, "field": self.field}


@dataclass(frozen=True)
class EntitySpec:
    key: str  # the batch key ("turns")
    table: str  # the table ("turn")
    refs: dict[str, str] = field(default_factory=dict)  # reference column -> referenced table
    natural_key: tuple[str, ...] = ()  # columns of a UNIQUE constraint usable for upserts


# Dependency order: a record may only reference kinds listed before it.
SPECS: tuple[EntitySpec, ...] = (
    EntitySpec("training", "training", natural_key=("run_name",)),
    EntitySpec("tasks", "task", natural_key=("task_id",)),
    EntitySpec("validators", "validator", refs={"task_id": "task"}),
    EntitySpec("steps", "step", {"training_id": "training"}, ("training_id", "step")),
    EntitySpec("baselines", "baseline", {"training_id": "training"}),
    EntitySpec("evals", "eval", {"training_id": "training"}, ("training_id", "step")),
    EntitySpec(
        "rollouts",
        "rollout",
        {"step_id": "step", "eval_id": "eval", "baseline_id": "baseline", "task_id": "task"},
        ("rollout_id",),
    ),
    EntitySpec("environments", "environment", {"rollout_id": "rollout"}),
    EntitySpec("turns", "turn", {"rollout_id": "rollout"}, ("rollout_id", "turn")),
    EntitySpec("actions", "action", {"turn_id": "turn"}),
    EntitySpec("observations", "obs", {"turn_id": "turn"}),
    EntitySpec("validations", "validation", {"rollout_id": "rollout", "validator_id": "validator"}),
)
SPEC_BY_KEY = {s.key: s for s in SPECS}
BATCH_KEYS = tuple(s.key for s in SPECS)

# Which column a named CHECK constraint is about, for error messages.
_CONSTRAINT_FIELDS = {
    "status_vocabulary": "status",
    "source_type_vocabulary": "source_type",
    "source_exactly_one_id": "source_type",
    "source_id_matches_type": "source_type",
}
_SOURCE_ID_COLUMNS = {"step": "step_id", "eval": "eval_id", "baseline": "baseline_id"}


def now_timestamp() -> str:
    """UTC time in SQLite's CURRENT_TIMESTAMP layout, with microseconds (sorts as text)."""
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def _epoch_to_timestamp(value: float) -> str:
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


try:  # orjson is several times faster for the JSON columns (tokens, logprobs, args)
    import orjson

    _ORJSON_OPTS = orjson.OPT_NON_STR_KEYS

    def _to_json(value: Any) -> str:
        try:
            return orjson.dumps(value, default=str, option=_ORJSON_OPTS).decode()
        except TypeError:  # e.g. integers beyond 64 bits
            return json.dumps(value, separators=(",", ":"), default=str)

except ImportError:  # pragma: no cover - depends on the environment

    def _to_json(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"), default=str)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


@dataclass
class _Column:
    name: str
    type: str
    required: bool  # NOT NULL without a default: must be present on insert


class _BadField(Exception):
    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name
        self.message = message


def _convert(col: _Column, value: Any) -> Any:
    if value is None:
        return None
    kind = col.type
    if kind == "INTEGER":
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _BadField(col.name, f"expected an integer, got {type(value).__name__} {value!r:.60}")
    if kind == "REAL":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _BadField(col.name, f"expected a number, got {type(value).__name__} {value!r:.60}")
    if kind == "TIMESTAMP":
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _epoch_to_timestamp(float(value))
        raise _BadField(
            col.name, f"expected a timestamp (ISO text or epoch seconds), got {value!r:.60}"
        )
    # TEXT: structured values become JSON, scalars their text.
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return _to_json(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    raise _BadField(col.name, f"expected text, got {type(value).__name__}")


class MonitorStore:
    """SQLite-backed store. Thread-safe: one writer under a lock, one reader per thread."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._write = connect(self.path)
        migrate(self._write)
        self.db = sqlite_utils.Database(self._write, recursive_triggers=False)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._columns: dict[str, dict[str, _Column]] = {}
        for spec in SPECS:
            cols = {}
            for c in self.db[spec.table].columns:
                if c.name == "id":
                    continue
                required = bool(c.notnull) and c.default_value is None
                cols[c.name] = _Column(c.name, (c.type or "TEXT").upper(), required)
            self._columns[spec.table] = cols
        self._required = {
            t: [c.name for c in cs.values() if c.required] for t, cs in self._columns.items()
        }
        self._sql: dict[tuple, str] = {}

    def close(self) -> None:
        with self._lock:
            for conn in self._readers:
                conn.close()
            self._readers.clear()
            self._write.close()

    # ------------------------------------------------------------------ ingest

    def ingest(self, batch: Any) -> dict[str, Any]:
        """Apply one batch atomically; returns ``{"training_id", <key>: [{client_id, id}]}``."""
        if not isinstance(batch, dict):
            raise IngestValidationError("the batch must be a JSON object")
        unknown = sorted(set(batch) - set(BATCH_KEYS))
        if unknown:
            raise IngestValidationError(
                f"unknown batch key(s) {unknown}; expected some of {list(BATCH_KEYS)}",
                kind=unknown[0],
            )
        with self._lock:
            conn = self._write
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = self._apply(conn, batch)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return result

    def _apply(self, conn: sqlite3.Connection, batch: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        ctx = _BatchContext(conn)
        for spec in SPECS:
            if spec.key not in batch or batch[spec.key] is None:
                continue
            records = batch[spec.key]
            if spec.key == "training":
                if not isinstance(records, dict):
                    raise IngestValidationError("must be one object", kind="training")
                cid, rid = self._upsert(ctx, spec, 0, records)
                ctx.write_keys()
                result["training_id"] = rid
                result["training"] = {"client_id": cid, "id": rid}
                continue
            if not isinstance(records, list):
                raise IngestValidationError("must be an array of objects", kind=spec.key)
            ctx.prefetch(spec.table, records)
            out: list[dict[str, Any]] = []
            group = _InsertGroup(out)
            for index, record in enumerate(records):
                cid = record.get("client_id") if isinstance(record, dict) else None
                eligible = isinstance(cid, str)
                if not eligible or cid in group.ids:
                    # Records without a client id look rows up by natural key, and a repeated
                    # client id updates its first occurrence: both need the pending rows written.
                    self._flush_group(ctx, spec, group)
                cid, rid = self._upsert(ctx, spec, index, record, group if eligible else None)
                out.append({"client_id": cid, "id": rid})
            self._flush_group(ctx, spec, group)
            ctx.write_keys()
            result[spec.key] = out
        return result

    def _upsert(
        self,
        ctx: _BatchContext,
        spec: EntitySpec,
        index: int,
        record: Any,
        group: _InsertGroup | None = None,
    ):
        if not isinstance(record, dict):
            raise IngestValidationError("must be an object", kind=spec.key, index=index)
        table = spec.table
        columns = self._columns[table]
        values: dict[str, Any] = {}
        extras: dict[str, Any] = {}
        client_id = record.get("client_id")
        if client_id is not None and not isinstance(client_id, str):
            client_id = str(client_id)
        conn = ctx.conn
        try:
            training_row = None  # a training named by its server id (an update)
            env_ref = None  # (field, environment id): the rollout names its environment
            aliased = table in compat.FIELD_ALIASES
            for name, value in record.items():
                if name == "client_id":
                    continue
                if table == "training" and name == "training_id":
                    if value is not None:
                        training_row = ctx.resolve("training", value, name)
                    continue
                if table == "rollout" and name in compat.ENV_REFERENCES:
                    env_ref = self._env_reference(ctx, record, name, value) or env_ref
                    continue
                if name in spec.refs:
                    if value is not None:
                        values[name] = ctx.resolve(spec.refs[name], value, name)
                    else:
                        values[name] = None
                    continue
                if name.endswith("_client_id"):
                    ref = name[: -len("_client_id")] + "_id"
                    if ref in spec.refs:
                        if value is not None and ref not in record:
                            values[ref] = ctx.resolve(spec.refs[ref], str(value), name)
                        continue
                if aliased:
                    name = compat.seed_name(table, name, record)
                col = columns.get(name)
                if col is None:
                    extras[name] = value
                else:
                    values[name] = _convert(col, value)
            if table == "rollout" and "source_type" not in values:
                present = [s for s, c in _SOURCE_ID_COLUMNS.items() if values.get(c) is not None]
                if len(present) == 1:
                    values["source_type"] = present[0]
            original = None  # a status word of the existing clients, stored as the seed's word
            mapped = compat.map_status(table, values.get("status"))
            if mapped is not None:
                original, values["status"] = values["status"], mapped
                extras[compat.ORIGINAL_STATUS] = original
            if training_row is not None:
                row_id = training_row
                if client_id is None:
                    client_id = conn.execute(
                        "SELECT run_name FROM training WHERE id = ?", (row_id,)
                    ).fetchone()[0]
            elif client_id is not None:
                # Known client id: update. Unknown: insert, and only if that hits the natural
                # key (a row made under another client id) look it up; saves a query per row.
                row_id = ctx.lookup_client(table, client_id)
            else:
                row_id = ctx.find(spec, None, values)
                client_id = ctx.derive_client_id(spec, values, record, row_id)
                if row_id is None:
                    row_id = ctx.lookup_client(table, client_id)
            self._check_values(table, values, inserting=row_id is None)
            if env_ref is not None:
                owner = compat.environment_owner(conn, env_ref[1])
                if owner is not None and owner != row_id:
                    raise _BadField(
                        env_ref[0], f"environment {env_ref[1]} belongs to rollout {owner}"
                    )
            # A seed word replaces a mapped one: the kept original no longer describes the row.
            forget_original = (
                mapped is None
                and "status" in values
                and table in compat.STATUS_ALIASES
                and row_id is not None
            )
            # These need the row's id right away (history, link, extras): no deferred insert.
            if original is not None or env_ref is not None:
                if group is not None:
                    self._flush_group(ctx, spec, group)
                group = None
            if row_id is None:
                if table == "training":
                    for name, default in compat.TRAINING_DEFAULTS.items():
                        if values.get(name) is None:
                            values[name] = default
                for name in self._required[table]:
                    if values.get(name) is None:
                        raise _BadField(name, "is required to create this record")
                if group is not None:
                    names = tuple(values)
                    if group.names is not None and group.names != names:
                        self._flush_group(ctx, spec, group)
                    group.add(index, client_id, names, values, extras)
                    return client_id, None  # the id is filled in when the group is written
        except _BadField as exc:
            raise IngestValidationError(
                exc.message, kind=spec.key, index=index, field=exc.field
            ) from None
        except sqlite3.IntegrityError as exc:
            raise _integrity_error(spec, index, exc) from None
        mark = compat.history_mark(conn) if original is not None else 0
        row_id = self._write_record(ctx, spec, index, client_id, row_id, values, extras)
        if original is not None:
            compat.note_original_status(conn, table, row_id, original, mark)
        elif forget_original:
            _drop_extra(conn, table, row_id, compat.ORIGINAL_STATUS)
        if env_ref is not None:
            compat.link_environment(conn, env_ref[1], row_id)
        return client_id, row_id

    @staticmethod
    def _env_reference(
        ctx: _BatchContext, record: dict, name: str, value: Any
    ) -> tuple[str, int] | None:
        """The environment a rollout names (``env_id``: server or client id; ``env_client_id``:
        client id, unless ``env_id`` is sent too); it must have been sent in an earlier batch."""
        if value is None or (name == "env_client_id" and record.get("env_id") is not None):
            return None
        ref = str(value) if name == "env_client_id" else value
        return name, ctx.resolve("environment", ref, name)

    def _insert_sql(self, table: str, names: tuple[str, ...]) -> str:
        sql = self._sql.get((table, names))
        if sql is None:
            sql = self._sql[(table, names)] = (
                f"INSERT INTO {table} ({', '.join(_q(n) for n in names)}) "
                f"VALUES ({', '.join('?' * len(names))})"
            )
        return sql

    def _write_record(
        self,
        ctx: _BatchContext,
        spec: EntitySpec,
        index: int,
        client_id: str,
        row_id: int | None,
        values: dict[str, Any],
        extras: dict[str, Any],
    ) -> int:
        """Insert (falling back to the natural key's row) or update one prepared record."""
        table = spec.table
        conn = ctx.conn
        try:
            inserted = False
            if row_id is None:
                try:
                    sql = self._insert_sql(table, tuple(values))
                    row_id = conn.execute(sql, tuple(values.values())).lastrowid
                    inserted = True
                except sqlite3.IntegrityError as exc:
                    if "UNIQUE" not in str(exc):
                        raise
                    row_id = ctx.find(spec, None, values)
                    if row_id is None:
                        raise
            if inserted:
                ctx.new_keys.append((table, client_id, row_id))  # written once per kind
            else:
                if values:
                    sets = ", ".join(f"{_q(n)} = ?" for n in values)
                    conn.execute(
                        f"UPDATE {table} SET {sets} WHERE id = ?", [*values.values(), row_id]
                    )
                conn.execute(
                    "INSERT OR IGNORE INTO client_key (entity_type, client_id, entity_id) "
                    "VALUES (?, ?, ?)",
                    (table, client_id, row_id),
                )
            ctx.remember(table, client_id, row_id, values)
            if extras:
                _merge_extras(conn, table, row_id, extras)
        except _BadField as exc:
            raise IngestValidationError(
                exc.message, kind=spec.key, index=index, field=exc.field
            ) from None
        except sqlite3.IntegrityError as exc:
            raise _integrity_error(spec, index, exc) from None
        return row_id

    def _flush_group(self, ctx: _BatchContext, spec: EntitySpec, group: _InsertGroup) -> None:
        """Write pending inserts of one shape with one executemany.

        AUTOINCREMENT ids of rows inserted back to back by the only writer are consecutive, so
        the ids follow from ``sqlite_sequence``. If any row fails, the group is undone to its
        savepoint and written one by one, which names the failing record exactly and applies
        the natural-key fallback."""
        if not group.entries:
            return
        entries, names = group.take()
        table, conn = spec.table, ctx.conn
        conn.execute("SAVEPOINT monitor_group")
        try:
            conn.executemany(
                self._insert_sql(table, names), [tuple(e[2].values()) for e in entries]
            )
            last = conn.execute(
                "SELECT seq FROM sqlite_sequence WHERE name = ?", (table,)
            ).fetchone()[0]
            conn.execute("RELEASE monitor_group")
        except sqlite3.Error:
            conn.execute("ROLLBACK TO monitor_group")
            conn.execute("RELEASE monitor_group")
            for index, client_id, values, extras in entries:
                group.out[index]["id"] = self._write_record(
                    ctx, spec, index, client_id, None, values, extras
                )
            return
        first = last - len(entries) + 1
        for k, (index, client_id, values, extras) in enumerate(entries):
            row_id = first + k
            ctx.new_keys.append((table, client_id, row_id))
            ctx.remember(table, client_id, row_id, values)
            if extras:
                _merge_extras(conn, table, row_id, extras)
            group.out[index]["id"] = row_id

    def _check_values(self, table: str, values: dict[str, Any], inserting: bool) -> None:
        # The database enforces these too; checking first gives messages that say how to fix it.
        status = values.get("status")
        if "status" in values and table in STATUSES and status not in STATUSES[table]:
            raise _BadField("status", f"{status!r} is not one of {list(STATUSES[table])}")
        if table == "rollout" and inserting:
            source = values.get("source_type")
            if source not in SOURCE_TYPES:
                raise _BadField(
                    "source_type",
                    f"{source!r} is not one of {list(SOURCE_TYPES)} (or send exactly one of "
                    "step_id / eval_id / baseline_id and it is inferred)",
                )
            own = _SOURCE_ID_COLUMNS[source]
            if values.get(own) is None:
                raise _BadField(own, f"is required when source_type is {source!r}")
            for other, col in _SOURCE_ID_COLUMNS.items():
                if other != source and values.get(col) is not None:
                    raise _BadField(col, f"must be empty when source_type is {source!r}")

    # ------------------------------------------------------------------ reads

    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = connect(self.path, read_only=True)
            self._local.conn = conn
            with self._lock:
                self._readers.append(conn)
        return conn

    def _rows(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        return [dict(r) for r in self._reader().execute(sql, params)]

    def _attach_extras(self, table: str, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        found = read_extras(self._reader(), table, [r["id"] for r in rows])
        for r in rows:
            if r["id"] in found:
                r["extra"] = found[r["id"]]

    def list_trainings(self, *, limit: int = 50, before_id: int | None = None) -> list[dict]:
        if before_id is None:
            rows = self._rows("SELECT * FROM training ORDER BY id DESC LIMIT ?", (limit,))
        else:
            rows = self._rows(
                "SELECT * FROM training WHERE id < ? ORDER BY id DESC LIMIT ?", (before_id, limit)
            )
        self._attach_extras("training", rows)
        return rows

    def get_training(self, training_id: int) -> dict[str, Any] | None:
        rows = self._rows("SELECT * FROM training WHERE id = ?", (training_id,))
        if not rows:
            return None
        training = rows[0]
        self._attach_extras("training", rows)
        for key, table, order in (
            ("steps", "step", "step, id"),
            ("evals", "eval", "step, id"),
            ("baselines", "baseline", "id"),
        ):
            items = self._rows(
                f"SELECT * FROM {table} WHERE training_id = ? ORDER BY {order}", (training_id,)
            )
            self._attach_extras(table, items)
            training[key] = items
        return training

    def list_rollouts(
        self, source_type: str, source_id: int, *, limit: int = 500, after_id: int = 0
    ) -> list[dict[str, Any]] | None:
        if source_type not in _SOURCE_ID_COLUMNS:
            raise ValueError(f"source_type must be one of {list(SOURCE_TYPES)}")
        parent = self._rows(f"SELECT id FROM {source_type} WHERE id = ?", (source_id,))
        if not parent:
            return None
        col = _SOURCE_ID_COLUMNS[source_type]
        rows = self._rows(
            f"SELECT * FROM rollout WHERE source_type = ? AND {col} = ? AND id > ? "
            "ORDER BY id LIMIT ?",
            (source_type, source_id, after_id, limit),
        )
        self._attach_extras("rollout", rows)
        return rows

    def get_rollout(self, rollout_id: int) -> dict[str, Any] | None:
        rows = self._rows("SELECT * FROM rollout WHERE id = ?", (rollout_id,))
        if not rows:
            return None
        rollout = rows[0]
        self._attach_extras("rollout", rows)
        turns = self._rows(
            "SELECT * FROM turn WHERE rollout_id = ? ORDER BY turn, id", (rollout_id,)
        )
        self._attach_extras("turn", turns)
        by_turn = {t["id"]: t for t in turns}
        for t in turns:
            t["actions"] = []
            t["observations"] = []
        for key, table in (("actions", "action"), ("observations", "obs")):
            items = self._rows(
                f"SELECT x.* FROM {table} x JOIN turn t ON x.turn_id = t.id "
                "WHERE t.rollout_id = ? ORDER BY x.id",
                (rollout_id,),
            )
            self._attach_extras(table, items)
            for item in items:
                by_turn[item["turn_id"]][key].append(item)
        rollout["turns"] = turns
        for key, table in (("validations", "validation"), ("environments", "environment")):
            items = self._rows(
                f"SELECT * FROM {table} WHERE rollout_id = ? ORDER BY id", (rollout_id,)
            )
            self._attach_extras(table, items)
            rollout[key] = items
        rollout["validation"] = rollout["validations"][-1] if rollout["validations"] else None
        rollout["environment"] = rollout["environments"][-1] if rollout["environments"] else None
        return rollout

    def status_history(self, entity_type: str, entity_id: int) -> list[dict[str, Any]]:
        if entity_type not in STATUSES:
            raise ValueError(f"entity_type must be one of {list(STATUSES)}")
        return self._rows(
            "SELECT * FROM status_history WHERE entity_type = ? AND entity_id = ? "
            "ORDER BY changed_at, id",
            (entity_type, entity_id),
        )

    def task_outcomes(self, run_name: str) -> tuple[int | None, list[dict[str, Any]]]:
        """Completed training rollouts of a run, aggregated per task and step (the curriculum's
        outcomes, docs/curriculum.md), with the training's id (``None``: no such run yet)."""
        found = self._rows("SELECT id FROM training WHERE run_name = ?", (run_name,))
        if not found:
            return None, []
        return found[0]["id"], self._rows(
            "SELECT t.task_id AS task_id, s.step AS step, COUNT(*) AS n, "
            "SUM(COALESCE(r.task_success, 0)) AS successes, SUM(r.reward) AS reward_sum, "
            "MIN(r.reward) AS reward_min, MAX(r.reward) AS reward_max "
            "FROM step s JOIN rollout r ON r.source_type = 'step' AND r.step_id = s.id "
            "JOIN task t ON t.id = r.task_id "
            "WHERE s.training_id = ? AND r.status = 'completed' AND r.reward IS NOT NULL "
            "GROUP BY t.task_id, s.step ORDER BY s.step, t.task_id",
            (found[0]["id"],),
        )

    def find_id(self, table: str, client_id: str) -> int | None:
        """The row id recorded for a client id (tests and tools)."""
        row = (
            self._reader()
            .execute(
                "SELECT entity_id FROM client_key WHERE entity_type = ? AND client_id = ?",
                (table, client_id),
            )
            .fetchone()
        )
        return row[0] if row else None


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


class _InsertGroup:
    """Consecutive new records of one kind and one set of columns, written together."""

    def __init__(self, out: list[dict[str, Any]]):
        self.out = out  # the kind's answer list; ids are filled in at write time
        self.entries: list[tuple[int, str, dict[str, Any], dict[str, Any]]] = []
        self.ids: set[str] = set()
        self.names: tuple[str, ...] | None = None

    def add(self, index: int, client_id: str, names: tuple, values: dict, extras: dict) -> None:
        self.names = names
        self.entries.append((index, client_id, values, extras))
        self.ids.add(client_id)

    def take(self):
        entries, names = self.entries, self.names
        self.entries, self.ids, self.names = [], set(), None
        return entries, names


def _integrity_error(spec: EntitySpec, index: int, exc: sqlite3.IntegrityError):
    message = str(exc)
    return IngestValidationError(
        _explain_integrity(spec.table, message),
        kind=spec.key,
        index=index,
        field=_integrity_field(spec.table, message),
    )


def _q(name: str) -> str:
    return f'"{name}"'


def _merge_extras(conn: sqlite3.Connection, table: str, row_id: int, extras: dict) -> None:
    row = conn.execute(
        "SELECT fields_json FROM extra_field WHERE entity_type = ? AND entity_id = ?",
        (table, row_id),
    ).fetchone()
    merged = json.loads(row[0]) if row else {}
    merged.update(extras)
    conn.execute(
        "INSERT INTO extra_field (entity_type, entity_id, fields_json) VALUES (?, ?, ?) "
        "ON CONFLICT (entity_type, entity_id) DO UPDATE SET fields_json = excluded.fields_json",
        (table, row_id, json.dumps(merged, separators=(",", ":"), default=str)),
    )


def _drop_extra(conn: sqlite3.Connection, table: str, row_id: int, key: str) -> None:
    row = conn.execute(
        "SELECT fields_json FROM extra_field WHERE entity_type = ? AND entity_id = ?",
        (table, row_id),
    ).fetchone()
    if row is None:
        return
    fields = json.loads(row[0])
    if fields.pop(key, None) is None:
        return
    conn.execute(
        "UPDATE extra_field SET fields_json = ? WHERE entity_type = ? AND entity_id = ?",
        (json.dumps(fields, separators=(",", ":"), default=str), table, row_id),
    )


def _integrity_field(table: str, message: str) -> str | None:
    m = re.search(r"constraint failed: (\w+)\.(\w+)", message)
    if m:
        return m.group(2)
    m = re.search(r"CHECK constraint failed: (\w+)", message)
    if m:
        return _CONSTRAINT_FIELDS.get(m.group(1))
    return None


def _explain_integrity(table: str, message: str) -> str:
    if "FOREIGN KEY" in message:
        return "references a record that does not exist"
    if "UNIQUE" in message:
        return (
            f"conflicts with an existing {table} ({message}); send the same client_id to update it"
        )
    return f"refused by the database ({message})"


class _BatchContext:
    """Per-batch caches: client id -> row id, existence of referenced ids, rollout uuids."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn
        self.known: dict[tuple[str, str], int] = {}
        self.exists: set[tuple[str, int]] = set()
        self.rollout_uuid: dict[int, str] = {}
        self.occurrences: dict[tuple[str, str], int] = {}
        self.absent: set[tuple[str, str]] = set()
        self.new_keys: list[tuple[str, str, int]] = []

    def write_keys(self) -> None:
        # Client ids first seen in this batch (a repeat within the batch may have written its
        # key already on the update path, hence OR IGNORE).
        if self.new_keys:
            self.conn.executemany(
                "INSERT OR IGNORE INTO client_key (entity_type, client_id, entity_id) "
                "VALUES (?, ?, ?)",
                self.new_keys,
            )
            self.new_keys.clear()

    def prefetch(self, table: str, records: list) -> None:
        """One query per 500 client ids instead of one per record."""
        ids = [
            r["client_id"]
            for r in records
            if isinstance(r, dict) and isinstance(r.get("client_id"), str)
        ]
        ids = [i for i in dict.fromkeys(ids) if (table, i) not in self.known]
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            rows = self.conn.execute(
                "SELECT client_id, entity_id FROM client_key WHERE entity_type = ? "
                f"AND client_id IN ({', '.join('?' * len(chunk))})",
                (table, *chunk),
            ).fetchall()
            found = {r[0]: r[1] for r in rows}
            for cid in chunk:
                if cid in found:
                    self.known[(table, cid)] = found[cid]
                else:
                    self.absent.add((table, cid))

    def lookup_client(self, table: str, client_id: str) -> int | None:
        key = (table, client_id)
        if key in self.known:
            return self.known[key]
        if key in self.absent:
            return None
        row = self.conn.execute(
            "SELECT entity_id FROM client_key WHERE entity_type = ? AND client_id = ?", key
        ).fetchone()
        if row is None:
            return None
        self.known[key] = row[0]
        return row[0]

    def resolve(self, table: str, value: Any, field_name: str) -> int:
        if isinstance(value, bool):
            raise _BadField(field_name, "expected a server id (integer) or a client id (text)")
        if isinstance(value, int):
            if (table, value) not in self.exists:
                if self.conn.execute(f"SELECT 1 FROM {table} WHERE id = ?", (value,)).fetchone():
                    self.exists.add((table, value))
                else:
                    raise _BadField(field_name, f"no {table} with id {value}")
            return value
        if isinstance(value, str):
            row_id = self.lookup_client(table, value)
            if row_id is None and table == "task":
                # A task's natural key is its task id, also for tasks created by other means.
                row = self.conn.execute(
                    "SELECT id FROM task WHERE task_id = ?", (value,)
                ).fetchone()
                row_id = row[0] if row else None
            if row_id is None and table == "rollout":
                row = self.conn.execute(
                    "SELECT id FROM rollout WHERE rollout_id = ?", (value,)
                ).fetchone()
                row_id = row[0] if row else None
            if row_id is None:
                raise _BadField(
                    field_name,
                    f"no {table} with client id {value!r} (send it earlier or in this batch)",
                )
            return row_id
        raise _BadField(field_name, f"expected a server id or client id, got {value!r:.60}")

    def find(self, spec: EntitySpec, client_id: str | None, values: dict) -> int | None:
        if client_id is not None:
            row_id = self.lookup_client(spec.table, client_id)
            if row_id is not None:
                return row_id
        if spec.natural_key and all(values.get(c) is not None for c in spec.natural_key):
            where = " AND ".join(f"{_q(c)} = ?" for c in spec.natural_key)
            row = self.conn.execute(
                f"SELECT id FROM {spec.table} WHERE {where}", [values[c] for c in spec.natural_key]
            ).fetchone()
            if row:
                return row[0]
        return None

    def uuid_of(self, rollout_id: int) -> str | None:
        if rollout_id not in self.rollout_uuid:
            row = self.conn.execute(
                "SELECT rollout_id FROM rollout WHERE id = ?", (rollout_id,)
            ).fetchone()
            self.rollout_uuid[rollout_id] = row[0] if row else None
        return self.rollout_uuid[rollout_id]

    def derive_client_id(self, spec: EntitySpec, values: dict, record: dict, row_id) -> str:
        table = spec.table
        if table == "training" and values.get("run_name"):
            return values["run_name"]
        if table == "task" and values.get("task_id"):
            return values["task_id"]
        if table == "rollout" and values.get("rollout_id"):
            return values["rollout_id"]
        if (
            table == "step"
            and values.get("training_id") is not None
            and values.get("step") is not None
        ):
            return f"step-{values['training_id']}-{values['step']}-{values.get('batch') or 0}"
        if (
            table == "eval"
            and values.get("training_id") is not None
            and values.get("step") is not None
        ):
            return f"eval-{values['training_id']}-{values['step']}"
        if table in ("turn", "environment") and values.get("rollout_id") is not None:
            uuid = self.uuid_of(values["rollout_id"])
            if table == "environment":
                return f"{uuid}:env"
            if values.get("turn") is not None:
                return f"{uuid}:turn:{values['turn']}"
        if row_id is not None:
            return f"{table}:{row_id}"
        # No natural key: the content identifies the record, so a retried batch maps to the same
        # rows; identical records within one batch are told apart by their occurrence number.
        digest = hashlib.sha256(f"{table}\0{_canonical(record)}".encode()).hexdigest()[:32]
        n = self.occurrences.get((table, digest), 0)
        self.occurrences[(table, digest)] = n + 1
        return f"{table}:sha256:{digest}:{n}"

    def remember(self, table: str, client_id: str, row_id: int, values: dict) -> None:
        self.known[(table, client_id)] = row_id
        self.exists.add((table, row_id))
        if table == "rollout" and values.get("rollout_id"):
            self.rollout_uuid[row_id] = values["rollout_id"]
