"""Open a monitor database and bring it to the newest schema version.

Each migration runs in its own transaction together with the row that records it in
``schema_migrations``, so a crash mid-migration leaves the database at the previous version.
Connections get WAL (readers never block the single writer) and foreign keys on; the store
writes the WAL back into the file when it closes (``checkpoint``), so that a finished run's
database is one file.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import sqlite_utils

from cua_rl.logs import get_logger
from cua_rl.monitor.server.schema import MIGRATIONS, Migration

log = get_logger(__name__)

BUSY_TIMEOUT_S = 10.0
_PRAGMAS = (
    "PRAGMA foreign_keys = ON",
    # NORMAL in WAL mode survives a killed process; only an OS crash can lose the last commits.
    "PRAGMA synchronous = NORMAL",
    f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}",
    # The updated_at triggers update their own table; they rely on this staying off.
    "PRAGMA recursive_triggers = OFF",
)


def connect(path: str | Path, *, read_only: bool = False) -> sqlite3.Connection:
    """A connection with the monitor's pragmas; autocommit, so transactions are explicit."""
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    for pragma in _PRAGMAS:
        conn.execute(pragma)
    if read_only:
        conn.execute("PRAGMA query_only = ON")
    return conn


def checkpoint(conn: sqlite3.Connection) -> None:
    """The WAL's pages written into the database file and the WAL emptied (``TRUNCATE``). A
    reader in the middle of a read keeps the pages it needs: those stay in the WAL, and the
    file alone lacks them (logged, as a copy of it would be incomplete)."""
    busy, logged, done = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    if busy or done < logged:
        log.warning(
            "monitor database: %s of %s WAL pages written back (a reader held the rest); copy "
            "the -wal file with it",
            done,
            logged,
        )


def write_back(path: str | Path) -> None:
    """``checkpoint`` on a connection of its own, closed at once: when it is the file's last,
    SQLite also removes the (empty) WAL and shared-memory files, which a read-only connection
    re-creates and leaves."""
    conn = connect(path)
    try:
        checkpoint(conn)
    finally:
        conn.close()


def current_version(db: sqlite_utils.Database) -> int:
    if "schema_migrations" not in db.table_names():
        return 0
    row = db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
    return row[0] or 0


def migrate(conn: sqlite3.Connection, migrations: tuple[Migration, ...] = MIGRATIONS) -> list[int]:
    """Apply the migrations newer than the database; returns the versions applied."""
    mode = _switch_to_wal(conn)
    if str(mode).lower() != "wal" and conn.execute("PRAGMA database_list").fetchone()[2]:
        raise RuntimeError(f"could not switch the monitor database to WAL (journal_mode={mode})")
    db = sqlite_utils.Database(conn, recursive_triggers=False)
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        "version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
        "applied_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)"
    )
    applied = []
    versions = [m.version for m in migrations]
    if versions != sorted(set(versions)):
        raise ValueError(f"migration versions must be unique and increasing, got {versions}")
    for migration in migrations:
        # The version is read again inside the write transaction, so two processes opening a
        # new file at once cannot both apply the same migration.
        conn.execute("BEGIN IMMEDIATE")
        try:
            if current_version(db) >= migration.version:
                conn.execute("ROLLBACK")
                continue
            for statement in _statements(migration.sql):
                conn.execute(statement)
            conn.execute(
                "INSERT INTO schema_migrations (version, name) VALUES (?, ?)",
                (migration.version, migration.name),
            )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        applied.append(migration.version)
    conn.execute("PRAGMA foreign_keys = ON")  # a no-op inside a transaction; outside, assured
    return applied


def _switch_to_wal(conn: sqlite3.Connection) -> str:
    """``PRAGMA journal_mode = WAL``, waiting as long as the busy timeout for the lock.

    The switch takes the database's lock without SQLite's busy handler: while another
    connection holds it (another process opening the same new file and switching it, or
    creating its tables), it fails at once with "database is locked" whatever busy_timeout is.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            return conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(0.01)


def _statements(sql: str) -> list[str]:
    """Split a script into complete statements (trigger bodies hold ``;`` of their own)."""
    out, current = [], ""
    for line in sql.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            if current.strip():
                out.append(current.strip())
            current = ""
    if current.strip():
        raise ValueError(f"incomplete SQL statement in migration: {current.strip()[:80]!r}")
    return out
