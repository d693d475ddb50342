"""The monitor's ingest: atomic, idempotent batch upserts (no HTTP); reads are in read.py.

``ingest(batch)`` writes one batch in one transaction: records are applied in dependency order
(training, tasks, validators, steps, baselines, evals, rollouts, environments, turns, actions,
observations, validations, then the warehouse's episodes: cua_rl/monitor/server/episodes.py), so a
record may reference one sent earlier in the same batch. Any bad
record rolls the whole batch back and raises :class:`IngestValidationError` naming the array,
the record's index and the field.

Idempotency: every row gets a client id (sent, or derived: the formats of cua_rl/monitor/protocol.py for entities
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

import sqlite3
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlite_utils

from cua_rl.monitor.protocol import (
    AUDIT_KINDS,
    EPISODE_KIND,
    IMAGE_KIND,
    MAX_BATCH_KEY_CHARS,
    SOURCE_ID_COLUMNS,
    SOURCE_TYPES,
    STATUSES,
)
from cua_rl.monitor.server import audits, compat, episodes, safety
from cua_rl.monitor.server.batch import (
    BATCH_KEYS,
    SPECS,
    BadField,
    BatchContext,
    Column,
    EntitySpec,
    IngestValidationError,
    InsertGroup,
    convert,
    drop_extra,
    merge_extras,
    quote,
    record_errors,
)
from cua_rl.monitor.server.migrations import checkpoint, connect, migrate
from cua_rl.monitor.server.read import MonitorReader


class MonitorStore:
    """SQLite-backed store. Thread-safe: one writer under a lock, one reader per thread."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._write = connect(self.path)
        migrate(self._write)
        self.db = sqlite_utils.Database(self._write, recursive_triggers=False)
        self._lock = threading.Lock()
        self.read = MonitorReader(self.path)
        self._columns: dict[str, dict[str, Column]] = {}
        for spec in SPECS:
            cols = {}
            for c in self.db[spec.table].columns:
                if c.name == "id":
                    continue
                required = bool(c.notnull) and c.default_value is None
                cols[c.name] = Column(c.name, (c.type or "TEXT").upper(), required)
            self._columns[spec.table] = cols
        self._required = {
            t: [c.name for c in cs.values() if c.required] for t, cs in self._columns.items()
        }
        self._sql: dict[tuple, str] = {}

    def close(self) -> None:
        """Close, with the WAL written back into the database file first, so that the file
        alone (copied, mailed) holds every record. Closing the last connection would do it too,
        but any reader still open elsewhere (a dashboard, the demo's progress) prevents that."""
        self.read.close()
        with self._lock:
            checkpoint(self._write)
            self._write.close()

    # ------------------------------------------------------------------ ingest

    def ingest(self, batch: Any, key: str | None = None) -> dict[str, Any]:
        """Apply one batch atomically; returns ``{"training_id", <key>: [{client_id, id}]}``.

        ``key``: the batch's idempotency key. A batch whose key was applied before is not
        applied again (``{"replayed": True}``): the same records sent again after an answer was
        lost (the client spools and replays the batch) would otherwise walk a record through
        the status changes the batch holds a second time."""
        if key is not None and (
            not isinstance(key, str) or not 0 < len(key) <= MAX_BATCH_KEY_CHARS
        ):
            raise IngestValidationError(
                f"the idempotency key must be a string of 1 to {MAX_BATCH_KEY_CHARS} characters"
            )
        if not isinstance(batch, dict):
            raise IngestValidationError("the batch must be a JSON object")
        unknown = sorted(set(batch) - set(BATCH_KEYS) - {EPISODE_KIND, *AUDIT_KINDS})
        if unknown:
            raise IngestValidationError(
                f"unknown batch key(s) {unknown}; expected some of "
                f"{[*BATCH_KEYS, EPISODE_KIND, *AUDIT_KINDS]} ({IMAGE_KIND} only over HTTP)",
                kind=unknown[0],
            )
        with self._lock:
            conn = self._write
            conn.execute("BEGIN IMMEDIATE")
            try:
                if key is not None and self._applied(conn, key):
                    result = {"replayed": True}
                else:
                    result = self._apply(conn, batch)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return result

    @staticmethod
    def _applied(conn: sqlite3.Connection, key: str) -> bool:
        """Whether the batch of ``key`` was applied; if not, it is now (the caller's transaction
        applies it)."""
        cur = conn.execute("INSERT OR IGNORE INTO applied_batch (batch_key) VALUES (?)", (key,))
        return cur.rowcount == 0

    def _apply(self, conn: sqlite3.Connection, batch: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        ctx = BatchContext(conn)
        for spec in SPECS:
            if spec.key not in batch or batch[spec.key] is None:
                continue
            records = batch[spec.key]
            if spec.key == "training":
                if not isinstance(records, dict):
                    raise IngestValidationError("must be one object", kind="training")
                cid, rid = self._upsert(ctx, spec, 0, records)
                safety.revive_if_back(conn, rid, records)
                ctx.write_keys()
                result["training_id"] = rid
                result["training"] = {"client_id": cid, "id": rid}
                continue
            if not isinstance(records, list):
                raise IngestValidationError("must be an array of objects", kind=spec.key)
            ctx.prefetch(spec.table, records)
            out: list[dict[str, Any]] = []
            group = InsertGroup(out)
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
        if batch.get(EPISODE_KIND) is not None:  # last: an episode names its rollout
            result[EPISODE_KIND] = episodes.apply_episodes(ctx, batch[EPISODE_KIND])
        result.update(audits.apply_audits(conn, batch))
        self._settle(conn, result)
        return result

    @staticmethod
    def _settle(conn: sqlite3.Connection, result: dict[str, Any]) -> None:
        """The safety net, in the batch's transaction: a training this batch ended, or one
        already ended that the batch wrote open records under, gets them closed."""
        ended = safety.ended_owners(
            conn,
            [r["id"] for r in result.get("rollouts", ())],
            [r["id"] for r in result.get("environments", ())],
        )
        if result.get("training_id") is not None:
            ended |= safety.ended_owners_of(conn, [result["training_id"]])
        if ended:
            safety.close_under_ended(conn, ended, datetime.now(UTC))

    def _upsert(
        self,
        ctx: BatchContext,
        spec: EntitySpec,
        index: int,
        record: Any,
        group: InsertGroup | None = None,
    ):
        if not isinstance(record, dict):
            raise IngestValidationError("must be an object", kind=spec.key, index=index)
        table = spec.table
        client_id = record.get("client_id")
        if client_id is not None and not isinstance(client_id, str):
            client_id = str(client_id)
        conn = ctx.conn
        with record_errors(spec, index):
            values, extras, training_row, env_ref = self._fields(ctx, spec, record)
            if table == "rollout" and "source_type" not in values:
                present = [s for s, c in SOURCE_ID_COLUMNS.items() if values.get(c) is not None]
                if len(present) == 1:
                    values["source_type"] = present[0]
            original = None  # a status word of the existing clients, stored as the seed's word
            mapped = compat.map_status(table, values.get("status"))
            if mapped is not None:
                original, values["status"] = values["status"], mapped
                extras[compat.ORIGINAL_STATUS] = original
            row_id, client_id = self._target(ctx, spec, record, client_id, training_row, values)
            self._check_values(table, values, inserting=row_id is None)
            if env_ref is not None:
                owner = compat.environment_owner(conn, env_ref[1])
                if owner is not None and owner != row_id:
                    raise BadField(
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
                        raise BadField(name, "is required to create this record")
                if group is not None:
                    names = tuple(values)
                    if group.names is not None and group.names != names:
                        self._flush_group(ctx, spec, group)
                    group.add(index, client_id, names, values, extras)
                    return client_id, None  # the id is filled in when the group is written
        mark = compat.history_mark(conn) if original is not None else 0
        row_id = self._write_record(ctx, spec, index, client_id, row_id, values, extras)
        if original is not None:
            compat.note_original_status(conn, table, row_id, original, mark)
        elif forget_original:
            drop_extra(conn, table, row_id, compat.ORIGINAL_STATUS)
        if env_ref is not None:
            compat.link_environment(conn, env_ref[1], row_id)
        return client_id, row_id

    @staticmethod
    def _target(ctx: BatchContext, spec: EntitySpec, record, client_id, training_row, values):
        """The row a record updates (None: a new row) and its client id."""
        if training_row is not None:
            if client_id is None:
                client_id = ctx.conn.execute(
                    "SELECT run_name FROM training WHERE id = ?", (training_row,)
                ).fetchone()[0]
            return training_row, client_id
        if client_id is not None:
            # Known client id: update. Unknown: insert, and only if that hits the natural key
            # (a row made under another client id) look it up; saves a query per row.
            return ctx.lookup_client(spec.table, client_id), client_id
        row_id = ctx.find(spec, None, values)
        client_id = ctx.derive_client_id(spec, values, record, row_id)
        if row_id is None:
            row_id = ctx.lookup_client(spec.table, client_id)
        return row_id, client_id

    def _fields(self, ctx: BatchContext, spec: EntitySpec, record: dict):
        """A record's columns (converted, references resolved), its unknown fields, the training
        it updates by server id and the environment it names (``(field, id)``), if any."""
        table, columns = spec.table, self._columns[spec.table]
        values: dict[str, Any] = {}
        extras: dict[str, Any] = {}
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
                values[name] = None if value is None else ctx.resolve(spec.refs[name], value, name)
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
                values[name] = convert(col, value)
        return values, extras, training_row, env_ref

    @staticmethod
    def _env_reference(
        ctx: BatchContext, record: dict, name: str, value: Any
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
                f"INSERT INTO {table} ({', '.join(quote(n) for n in names)}) "
                f"VALUES ({', '.join('?' * len(names))})"
            )
        return sql

    def _write_record(
        self,
        ctx: BatchContext,
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
        with record_errors(spec, index):
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
                    sets = ", ".join(f"{quote(n)} = ?" for n in values)
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
                merge_extras(conn, table, row_id, extras)
        return row_id

    def _flush_group(self, ctx: BatchContext, spec: EntitySpec, group: InsertGroup) -> None:
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
                merge_extras(conn, table, row_id, extras)
            group.out[index]["id"] = row_id

    def _check_values(self, table: str, values: dict[str, Any], inserting: bool) -> None:
        # The database enforces these too; checking first gives messages that say how to fix it.
        status = values.get("status")
        if "status" in values and table in STATUSES and status not in STATUSES[table]:
            raise BadField("status", f"{status!r} is not one of {list(STATUSES[table])}")
        if table == "rollout" and inserting:
            source = values.get("source_type")
            if source not in SOURCE_TYPES:
                raise BadField(
                    "source_type",
                    f"{source!r} is not one of {list(SOURCE_TYPES)} (or send exactly one of "
                    "step_id / eval_id / baseline_id and it is inferred)",
                )
            own = SOURCE_ID_COLUMNS[source]
            if values.get(own) is None:
                raise BadField(own, f"is required when source_type is {source!r}")
            for other, col in SOURCE_ID_COLUMNS.items():
                if other != source and values.get(col) is not None:
                    raise BadField(col, f"must be empty when source_type is {source!r}")

    # ------------------------------------------------------------------ safety net

    def reap(self, heartbeat_timeout_s: float | None, now: datetime | None = None) -> dict:
        """One pass of the safety net in one transaction: close what is open under ended
        trainings, then fail the trainings silent past ``heartbeat_timeout_s`` (None: no
        reaping) and close theirs. ``now`` is injectable for tests."""
        now = now or datetime.now(UTC)
        with self._lock:
            conn = self._write
            conn.execute("BEGIN IMMEDIATE")
            try:
                closed = safety.close_under_ended(conn, safety.all_ended_owners(conn), now)
                reaped = []
                if heartbeat_timeout_s is not None:
                    reaped = safety.reap_silent(conn, heartbeat_timeout_s, now)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return {"closed": closed, "reaped": reaped}

    # ------------------------------------------------------------------ reads
    # The read model answers; these names stay for the API's and the tests' callers.

    def _reader(self) -> sqlite3.Connection:
        return self.read.conn()

    def list_trainings(self, *, limit: int = 50, before_id: int | None = None) -> list[dict]:
        return self.read.list_trainings(limit=limit, before_id=before_id)

    def get_training(self, training_id: int) -> dict[str, Any] | None:
        return self.read.get_training(training_id)

    def list_rollouts(self, source_type: str, source_id: int, **page: int):
        return self.read.list_rollouts(source_type, source_id, **page)

    def get_rollout(self, rollout_id: int) -> dict[str, Any] | None:
        return self.read.get_rollout(rollout_id)

    def status_history(self, entity_type: str, entity_id: int) -> list[dict[str, Any]]:
        return self.read.status_history(entity_type, entity_id)

    def task_outcomes(self, run_name: str) -> tuple[int | None, list[dict[str, Any]]]:
        return self.read.task_outcomes(run_name)

    def find_id(self, table: str, client_id: str) -> int | None:
        return self.read.find_id(table, client_id)
