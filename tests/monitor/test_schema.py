"""The database equals the seed document, read by parsing the document (nothing restated here),
and the database itself enforces statuses, the rollout source rule, history and updated_at."""

from __future__ import annotations

import re
import sqlite3
import threading

import pytest

from cua_rl.monitor.server.migrations import connect, migrate
from cua_rl.monitor.server.schema import MIGRATIONS
from cua_rl.monitor.server.store import MonitorStore

from .conftest import SEED

# ---------------------------------------------------------------- parsing the seed document


def _seed_text() -> str:
    assert SEED.exists(), f"seed document missing at {SEED}"
    return SEED.read_text()


def parse_seed_tables() -> dict[str, dict]:
    tables = {}
    for section in re.split(r"^### \d+\. ", _seed_text(), flags=re.M)[1:]:
        name = section.split()[0]
        columns, uniques = [], []
        for row in re.findall(r"^\|(.*)\|\s*$", section, flags=re.M):
            cells = [c.strip() for c in row.split("|")]
            if cells[0] == "Field Name" or set(cells[0]) <= {"-", ":"}:
                continue
            m = re.fullmatch(r"UNIQUE\((.*)\)", cells[0])
            if m:
                uniques.append(tuple(c.strip() for c in m.group(1).split(",")))
                continue
            col, typ, _desc, cons = cells[:4]
            pk = "PRIMARY KEY" in typ
            default = re.search(r"DEFAULT (\S+)", cons)
            ref = re.search(r"REFERENCES (\w+)\((\w+)\)", cons)
            columns.append(
                {
                    "name": col,
                    "type": typ.replace("PRIMARY KEY", "").strip(),
                    "pk": pk,
                    "notnull": "NOT NULL" in cons,
                    "default": default.group(1) if default else None,
                    "unique": bool(re.search(r"\bUNIQUE\b", cons)),
                    "references": (ref.group(1), ref.group(2)) if ref else None,
                    "autoincrement": "AUTOINCREMENT" in cons,
                }
            )
        tables[name] = {"columns": columns, "uniques": uniques}
    return tables


def parse_seed_indexes() -> list[tuple[str, tuple[str, ...]]]:
    section = _seed_text().split("## Index Design", 1)[1].split("\n## ", 1)[0]
    out = []
    for table, cols in re.findall(r"^\d+\. `(\w+)\(([^)]*)\)`", section, flags=re.M):
        out.append((table, tuple(c.strip() for c in cols.split(","))))
    return out


def parse_seed_statuses() -> dict[str, list[str]]:
    section = _seed_text().split("## Status Descriptions", 1)[1].split("\n## ", 1)[0]
    out: dict[str, list[str]] = {}
    for heading, body in re.findall(
        r"^### (.+?) Status\n(.*?)(?=^### |\Z)", section, flags=re.M | re.S
    ):
        values = re.findall(r"^- `(\w+)`", body, flags=re.M)
        for name in heading.split("/"):
            out[name.strip().lower()] = values
    return out


def test_seed_parser_finds_the_whole_document():
    # Guards the parser itself: a silent parse failure must not make the comparisons vacuous.
    tables = parse_seed_tables()
    assert len(tables) == 13
    assert all(len(t["columns"]) >= 7 for t in tables.values())
    assert len(parse_seed_indexes()) == 25
    assert set(parse_seed_statuses()) == {
        "training",
        "baseline",
        "eval",
        "step",
        "rollout",
        "environment",
    }


# ---------------------------------------------------------------- schema equals the seed


@pytest.fixture
def conn(store):
    return connect(store.path)


def _tables_in_db(conn) -> set[str]:
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


# The one departure from the seed's columns, made by migration 3 for the existing clients'
# dialect (docs/monitor.md, Compatibility): an environment may be recorded before its rollout.
RELAXED_NOT_NULL = {("environment", "rollout_id")}


def _columns(conn, table) -> list[tuple]:
    info = conn.execute(f"PRAGMA table_info({table})").fetchall()
    return [
        (r["name"], r["type"], bool(r["pk"]), bool(r["notnull"]), r["dflt_value"]) for r in info
    ]


@pytest.mark.parametrize("table", list(parse_seed_tables()))
def test_table_columns_equal_seed(conn, table):
    seed = parse_seed_tables()[table]
    assert table in _tables_in_db(conn)
    expected = [
        (
            c["name"],
            c["type"],
            c["pk"],
            c["notnull"] and (table, c["name"]) not in RELAXED_NOT_NULL,
            c["default"],
        )
        for c in seed["columns"]
    ]
    assert _columns(conn, table) == expected


@pytest.mark.parametrize("table", list(parse_seed_tables()))
def test_seed_migration_alone_equals_seed_exactly(tmp_path, table):
    conn = connect(tmp_path / "seed.db")
    migrate(conn, MIGRATIONS[:2])
    seed = parse_seed_tables()[table]
    expected = [
        (c["name"], c["type"], c["pk"], c["notnull"], c["default"]) for c in seed["columns"]
    ]
    assert _columns(conn, table) == expected


@pytest.mark.parametrize("table", list(parse_seed_tables()))
def test_table_keys_equal_seed(conn, table):
    seed = parse_seed_tables()[table]
    fks = {
        (r["from"], r["table"], r["to"]) for r in conn.execute(f"PRAGMA foreign_key_list({table})")
    }
    assert fks == {(c["name"], *c["references"]) for c in seed["columns"] if c["references"]}

    uniques = set()
    for idx in conn.execute(f"PRAGMA index_list({table})"):
        if idx["origin"] == "u":
            cols = tuple(r["name"] for r in conn.execute(f"PRAGMA index_info({idx['name']})"))
            uniques.add(cols)
    expected = {(c["name"],) for c in seed["columns"] if c["unique"]} | set(seed["uniques"])
    assert uniques == expected

    sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
    for c in seed["columns"]:
        if c["autoincrement"]:
            assert re.search(rf"\b{c['name']}\s+INTEGER\s+PRIMARY KEY\s+AUTOINCREMENT", sql)


def test_indexes_equal_seed(conn):
    seed_tables = set(parse_seed_tables())
    actual = []
    for table in seed_tables:
        for idx in conn.execute(f"PRAGMA index_list({table})"):
            if idx["origin"] == "c":
                cols = tuple(r["name"] for r in conn.execute(f"PRAGMA index_info({idx['name']})"))
                actual.append((table, cols))
    assert sorted(actual) == sorted(parse_seed_indexes())


def test_wal_foreign_keys_and_migration_version(store, tmp_path):
    conn = connect(store.path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    versions = [tuple(r) for r in conn.execute("SELECT version FROM schema_migrations")]
    assert versions == [(1,), (2,), (3,), (4,), (5,), (6,), (7,)]
    assert migrate(conn) == []  # reopening applies nothing twice
    with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
        conn.execute("INSERT INTO turn (rollout_id, turn) VALUES (999, 1)")
    # A second store on the same file sees the same schema, unchanged.
    again = MonitorStore(store.path)
    assert [
        tuple(r) for r in connect(store.path).execute("SELECT version FROM schema_migrations")
    ] == [(1,), (2,), (3,), (4,), (5,), (6,), (7,)]
    again.close()


# ---------------------------------------------------------------- database-enforced rules


def _parents(conn) -> dict[str, int]:
    conn.execute("INSERT INTO training (run_name, log_path, model_name) VALUES ('r', 'l', 'm')")
    ids = {"training": conn.execute("SELECT max(id) FROM training").fetchone()[0]}
    conn.execute("INSERT INTO task (task_id, name, description) VALUES ('t', 'n', 'd')")
    ids["task"] = conn.execute("SELECT max(id) FROM task").fetchone()[0]
    for table in ("step", "eval"):
        extra = ", model_path" if table == "eval" else ""
        extra_v = ", 'm'" if table == "eval" else ""
        conn.execute(
            f"INSERT INTO {table} (training_id, step{extra}) VALUES (?, 1{extra_v})",
            (ids["training"],),
        )
        ids[table] = conn.execute(f"SELECT max(id) FROM {table}").fetchone()[0]
    conn.execute(
        "INSERT INTO baseline (training_id, model_path) VALUES (?, 'm')", (ids["training"],)
    )
    ids["baseline"] = conn.execute("SELECT max(id) FROM baseline").fetchone()[0]
    conn.execute(
        "INSERT INTO rollout (source_type, step_id, rollout_id, task_id, model_path) "
        "VALUES ('step', ?, 'u0', ?, 'm')",
        (ids["step"], ids["task"]),
    )
    ids["rollout"] = conn.execute("SELECT max(id) FROM rollout").fetchone()[0]
    return ids


_INSERTS = {
    "training": (
        "INSERT INTO training (run_name, log_path, model_name, status) "
        "VALUES (:uniq, 'l', 'm', :status)"
    ),
    "baseline": "INSERT INTO baseline (training_id, model_path, status) VALUES (:training, 'm', :status)",
    "eval": "INSERT INTO eval (training_id, step, model_path, status) VALUES (:training, :n, 'm', :status)",
    "step": "INSERT INTO step (training_id, step, status) VALUES (:training, :n, :status)",
    "rollout": (
        "INSERT INTO rollout (source_type, step_id, rollout_id, task_id, model_path, status) "
        "VALUES ('step', :step, :uniq, :task, 'm', :status)"
    ),
    "environment": (
        "INSERT INTO environment (rollout_id, env_type, status) "
        "VALUES (:rollout, 'android', :status)"
    ),
}


@pytest.mark.parametrize("table", list(_INSERTS))
def test_status_vocabulary_enforced_by_database(conn, table):
    vocab = parse_seed_statuses()[table]
    every_status = {s for values in parse_seed_statuses().values() for s in values}
    ids = _parents(conn)
    for n, status in enumerate(vocab, start=100):
        conn.execute(_INSERTS[table], {**ids, "status": status, "uniq": f"{table}{n}", "n": n})
    foreign = sorted(every_status - set(vocab)) + ["bogus", None]
    for n, status in enumerate(foreign, start=200):
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            conn.execute(_INSERTS[table], {**ids, "status": status, "uniq": f"{table}{n}", "n": n})
    # Updates are checked too.
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        conn.execute(f"UPDATE {table} SET status = 'bogus'")


def test_the_workers_named_status_words_are_the_seeds():
    from cua_rl.monitor import protocol

    seed = parse_seed_statuses()
    named = {
        "training": ("RUNNING", "COMPLETED", "FAILED", "CANCELLED"),
        "step": ("ROLLOUT_RUNNING", "COMPLETED", "FAILED"),
        "eval": ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED"),
    }
    for table, names in named.items():
        for name in names:
            assert getattr(protocol, name) in seed[table], (table, name)


@pytest.mark.parametrize(
    ("source_type", "ids", "ok"),
    [
        ("step", ("step",), True),
        ("eval", ("eval",), True),
        ("baseline", ("baseline",), True),
        ("step", (), False),
        ("step", ("eval",), False),
        ("step", ("step", "eval"), False),
        ("eval", ("eval", "baseline"), False),
        ("baseline", ("step",), False),
        ("other", ("step",), False),
        (None, ("step",), False),
    ],
)
def test_rollout_source_rule_enforced_by_database(conn, source_type, ids, ok):
    parents = _parents(conn)
    values = {f"{k}_id": parents[k] if k in ids else None for k in ("step", "eval", "baseline")}
    sql = (
        "INSERT INTO rollout (source_type, step_id, eval_id, baseline_id, rollout_id, task_id, "
        "model_path) VALUES (:st, :step_id, :eval_id, :baseline_id, 'u1', :task, 'm')"
    )
    params = {"st": source_type, **values, "task": parents["task"]}
    if ok:
        conn.execute(sql, params)
    else:
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(sql, params)


def test_rollout_source_rule_holds_on_update(conn):
    parents = _parents(conn)
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        conn.execute(
            "UPDATE rollout SET eval_id = ? WHERE id = ?", (parents["eval"], parents["rollout"])
        )
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        conn.execute("UPDATE rollout SET source_type = 'eval' WHERE id = ?", (parents["rollout"],))


_NEXT = {
    "training": "running",
    "baseline": "running",
    "eval": "running",
    "step": "rollout_running",
    "rollout": "running",
    "environment": "running",
}


@pytest.mark.parametrize("table", list(_INSERTS))
def test_status_history_written_by_triggers(conn, table):
    ids = _parents(conn)
    conn.execute(_INSERTS[table], {**ids, "status": "pending", "uniq": "h1", "n": 7})
    row_id = conn.execute(f"SELECT max(id) FROM {table}").fetchone()[0]

    def history():
        return conn.execute(
            "SELECT old_status, new_status, progress_percent, status_message, changed_at "
            "FROM status_history WHERE entity_type = ? AND entity_id = ? ORDER BY id",
            (table, row_id),
        ).fetchall()

    assert [tuple(r)[:2] for r in history()] == [(None, "pending")]
    progress = ", progress_percent = 40.0" if table != "environment" else ""
    conn.execute(
        f"UPDATE {table} SET status = ?, status_message = 'went on'{progress} WHERE id = ?",
        (_NEXT[table], row_id),
    )
    rows = history()
    assert len(rows) == 2
    old, new, pct, msg, changed_at = rows[1]
    assert (old, new, msg) == ("pending", _NEXT[table], "went on")
    assert pct == (40.0 if table != "environment" else None)
    assert changed_at
    # A write that leaves the status alone adds no history.
    conn.execute(f"UPDATE {table} SET status_message = 'same status' WHERE id = ?", (row_id,))
    conn.execute(f"UPDATE {table} SET status = status WHERE id = ?", (row_id,))
    assert len(history()) == 2


def test_updated_at_maintained_by_trigger(conn):
    _parents(conn)
    conn.execute(
        "UPDATE training SET updated_at = '2000-01-01 00:00:00', created_at = '2000-01-01 00:00:00'"
    )
    conn.execute("UPDATE training SET status_message = 'x'")
    updated, created = conn.execute("SELECT updated_at, created_at FROM training").fetchone()
    assert created == "2000-01-01 00:00:00"
    assert updated > "2020"


def test_concurrent_first_opens_apply_migration_1_once(tmp_path):
    path = tmp_path / "race.db"
    errors, barrier = [], threading.Barrier(4)

    def open_store():
        try:
            barrier.wait(timeout=10)
            MonitorStore(path).close()
        except Exception as exc:  # collected: an assert in a thread would be lost
            errors.append(exc)

    threads = [threading.Thread(target=open_store) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    rows = connect(path).execute("SELECT version FROM schema_migrations").fetchall()
    assert [tuple(r) for r in rows] == [(1,), (2,), (3,), (4,), (5,), (6,), (7,)]


def test_opening_waits_for_a_lock_held_while_it_switches_to_wal(tmp_path):
    """Why concurrent first opens failed under load: switching a new file to WAL takes the
    lock without SQLite's busy handler, so an open that met another connection's lock failed at
    once ("database is locked"). Here the lock is held until the opener has provably met it
    (its switch runs a second time) and only then released."""
    path = tmp_path / "held.db"
    holder = connect(path)
    holder.execute("BEGIN IMMEDIATE")  # a new file, rollback journal: the lock the switch needs
    holder.execute("CREATE TABLE other (x)")
    opener = connect(path)
    switches, retried = [], threading.Event()

    def trace(sql: str) -> None:
        if sql.startswith("PRAGMA journal_mode"):
            switches.append(sql)
            if len(switches) == 2:
                retried.set()

    opener.set_trace_callback(trace)
    errors: list[BaseException] = []

    def open_db() -> None:
        try:
            migrate(opener)
        except BaseException as exc:  # collected: an assert in a thread would be lost
            errors.append(exc)
        finally:
            retried.set()

    thread = threading.Thread(target=open_db)
    thread.start()
    retried.wait(timeout=60)
    holder.execute("COMMIT")
    thread.join(timeout=60)
    assert errors == [] and len(switches) >= 2, (errors, switches)
    assert opener.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    rows = opener.execute("SELECT version FROM schema_migrations").fetchall()
    assert [tuple(r) for r in rows] == [(m.version,) for m in MIGRATIONS]
