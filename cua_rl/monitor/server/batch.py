"""One batch's ingest machinery: record kinds as specs, field conversion, the per-batch caches.

:data:`SPECS` lists the record kinds in dependency order with their references and natural keys.
:func:`convert` turns a JSON value into the column's type (epoch seconds into timestamps,
structures into JSON text) or raises :class:`BadField` naming the field. :class:`BatchContext`
caches client id -> row id lookups for one batch (one query per 500 ids), resolves references and
derives the client id of a record sent without one; :class:`InsertGroup` collects consecutive new
records of one shape for one ``executemany``. ``MonitorStore`` (store.py) drives them.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from cua_rl.errors import CuaRlError
from cua_rl.monitor.protocol import RECORD_TABLES, natural_client_id


class IngestValidationError(CuaRlError, ValueError):
    """A batch was refused; ``kind``/``index``/``field`` locate the offending record."""

    def __init__(
        self,
        message: str,
        *,
        kind: str | None = None,
        index: int | None = None,
        field: str | None = None,
        missing: str | None = None,
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
        self.missing = missing

    def details(self) -> dict[str, Any]:
        out = {"kind": self.kind, "index": self.index, "field": self.field}
        if self.missing:
            out["missing_reference"] = self.missing
        return out


@dataclass(frozen=True)
class EntitySpec:
    key: str  # the batch key ("turns")
    table: str  # the table ("turn")
    refs: dict[str, str] = field(default_factory=dict)  # reference column -> referenced table
    natural_key: tuple[str, ...] = ()  # columns of a UNIQUE constraint usable for upserts


# Per kind: reference column -> referenced table, and the natural key (protocol.RECORD_TABLES
# gives the kinds' order and tables).
_RELATIONS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "training": ({}, ("run_name",)),
    "tasks": ({}, ("task_id",)),
    "validators": ({"task_id": "task"}, ()),
    "steps": ({"training_id": "training"}, ("training_id", "step")),
    "baselines": ({"training_id": "training"}, ()),
    "evals": ({"training_id": "training"}, ("training_id", "step")),
    "pauses": ({"training_id": "training"}, ()),
    "rollouts": (
        {"step_id": "step", "eval_id": "eval", "baseline_id": "baseline", "task_id": "task"},
        ("rollout_id",),
    ),
    "environments": ({"rollout_id": "rollout"}, ()),
    "turns": ({"rollout_id": "rollout"}, ("rollout_id", "turn")),
    "actions": ({"turn_id": "turn"}, ()),
    "observations": ({"turn_id": "turn"}, ()),
    "validations": ({"rollout_id": "rollout", "validator_id": "validator"}, ()),
}
SPECS: tuple[EntitySpec, ...] = tuple(
    EntitySpec(key, table, *_RELATIONS[key]) for key, table in RECORD_TABLES.items()
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
class Column:
    name: str
    type: str
    required: bool  # NOT NULL without a default: must be present on insert


class BadField(Exception):
    def __init__(self, field_name: str, message: str, *, missing: str | None = None):
        super().__init__(message)
        self.field = field_name
        self.message = message
        # The table of a client-id reference not found: a client may wait for it (another
        # process sends trainings and steps, and replays its spool on its own schedule).
        self.missing = missing


def convert(col: Column, value: Any) -> Any:
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
        raise BadField(col.name, f"expected an integer, got {type(value).__name__} {value!r:.60}")
    if kind == "REAL":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise BadField(col.name, f"expected a number, got {type(value).__name__} {value!r:.60}")
    if kind == "TIMESTAMP":
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _epoch_to_timestamp(float(value))
        raise BadField(
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
    raise BadField(col.name, f"expected text, got {type(value).__name__}")


class InsertGroup:
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


def integrity_error(spec: EntitySpec, index: int, exc: sqlite3.IntegrityError):
    message = str(exc)
    return IngestValidationError(
        _explain_integrity(spec.table, message),
        kind=spec.key,
        index=index,
        field=_integrity_field(spec.table, message),
    )


@contextmanager
def record_errors(spec: EntitySpec, index: int) -> Iterator[None]:
    """A bad field, or a constraint the database refuses, as the batch's error for record
    ``index`` of ``spec``'s kind."""
    try:
        yield
    except BadField as exc:
        raise IngestValidationError(
            exc.message, kind=spec.key, index=index, field=exc.field, missing=exc.missing
        ) from None
    except sqlite3.IntegrityError as exc:
        raise integrity_error(spec, index, exc) from None


def quote(name: str) -> str:
    return f'"{name}"'


def merge_extras(conn: sqlite3.Connection, table: str, row_id: int, extras: dict) -> None:
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


def drop_extra(conn: sqlite3.Connection, table: str, row_id: int, key: str) -> None:
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


class BatchContext:
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
            raise BadField(field_name, "expected a server id (integer) or a client id (text)")
        if isinstance(value, int):
            if (table, value) not in self.exists:
                if self.conn.execute(f"SELECT 1 FROM {table} WHERE id = ?", (value,)).fetchone():
                    self.exists.add((table, value))
                else:
                    raise BadField(field_name, f"no {table} with id {value}")
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
                raise BadField(
                    field_name,
                    f"no {table} with client id {value!r} (send it earlier or in this batch)",
                    missing=table,
                )
            return row_id
        raise BadField(field_name, f"expected a server id or client id, got {value!r:.60}")

    def find(self, spec: EntitySpec, client_id: str | None, values: dict) -> int | None:
        if client_id is not None:
            row_id = self.lookup_client(spec.table, client_id)
            if row_id is not None:
                return row_id
        if spec.natural_key and all(values.get(c) is not None for c in spec.natural_key):
            where = " AND ".join(f"{quote(c)} = ?" for c in spec.natural_key)
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
        uuid = None
        if table in ("turn", "environment") and values.get("rollout_id") is not None:
            uuid = self.uuid_of(values["rollout_id"])
        natural = natural_client_id(table, values, uuid)
        if natural is not None:
            return natural
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
