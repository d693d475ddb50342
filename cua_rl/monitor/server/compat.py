"""The existing Training Monitor clients' dialect, read onto the seed schema.

The clients that posted to the Training Monitor before this project (docs/design.md) send records the
seed schema alone would refuse: a training without ``log_path`` / ``model_name``, a training
update that names only its ``training_id``, status words outside the seed's vocabularies, an
environment before its rollout (the rollout then names it by ``env_id``), and a few fields under
other names. :class:`~cua_rl.monitor.server.store.MonitorStore` applies the tables below while it
ingests; what they do not cover is checked as before. docs/monitor.md ("Compatibility") lists
each call of those clients and how it is stored.

Nothing is lost on the way: a mapped status keeps its original word (in the row's ``extra`` as
``client_status``, and in the ``metadata_json`` of the status_history row of that transition),
a field read under another name is stored under the seed's name, and fields the schema does not
name are kept in ``extra`` as for every client.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

# Status words the existing clients send that the seed's vocabulary of that table lacks, and the
# seed word each is stored as. A word already in the table's vocabulary is never mapped.
STATUS_ALIASES: dict[str, dict[str, str]] = {
    # Steps are posted "running" when their rollouts start (the seed splits that phase in two).
    "step": {"running": "rollout_running"},
    # The environment row is posted "created" before its box runs the agent.
    "environment": {"created": "creating"},
}

# Fields sent under another name than the seed's column: stored under the seed's name, unless
# the record also carries the seed's own field (then the other name is kept in ``extra``).
FIELD_ALIASES: dict[str, dict[str, str]] = {
    "rollout": {"group_num": "group"},
    "action": {"action_name": "tool_name", "action_args": "tool_args"},
}

# NOT NULL columns of the seed the existing clients do not send when they create a training.
# Empty text says "not given": the dashboard shows it blank, and a later update may set it.
TRAINING_DEFAULTS: dict[str, str] = {"log_path": "", "model_name": ""}

# The key under which a row's ``extra`` (and its status_history metadata) keeps a mapped word.
ORIGINAL_STATUS = "client_status"

# Keys by which a rollout names its environment (a server id, or the environment's client id).
ENV_REFERENCES = ("env_id", "env_client_id")


def seed_name(table: str, name: str, record: dict[str, Any]) -> str:
    """The column a field of ``record`` is stored under (its own name unless it is an alias)."""
    target = FIELD_ALIASES.get(table, {}).get(name)
    if target is not None and record.get(target) is None:
        return target
    return name


def map_status(table: str, status: Any) -> str | None:
    """The seed word for a status word of the existing clients; None when it needs no mapping."""
    aliases = STATUS_ALIASES.get(table)
    if aliases is None or not isinstance(status, str):
        return None
    return aliases.get(status)


def history_mark(conn: sqlite3.Connection) -> int:
    """The newest status_history id, taken before a write so its own rows can be found after."""
    return conn.execute("SELECT COALESCE(MAX(id), 0) FROM status_history").fetchone()[0]


def note_original_status(
    conn: sqlite3.Connection, table: str, row_id: int, word: str, mark: int
) -> None:
    """Keep ``word`` on the status_history rows the write after ``mark`` made for this row."""
    conn.execute(
        "UPDATE status_history SET metadata_json = ? "
        "WHERE id > ? AND entity_type = ? AND entity_id = ?",
        (json.dumps({ORIGINAL_STATUS: word}), mark, table, row_id),
    )


def environment_owner(conn: sqlite3.Connection, env_id: int) -> int | None:
    """The rollout an environment is linked to (None: not linked yet)."""
    row = conn.execute("SELECT rollout_id FROM environment WHERE id = ?", (env_id,)).fetchone()
    return row[0] if row else None


def link_environment(conn: sqlite3.Connection, env_id: int, rollout_id: int) -> None:
    """Fill the seed's ``environment.rollout_id`` once the rollout that names it is known."""
    conn.execute(
        "UPDATE environment SET rollout_id = ? WHERE id = ? AND rollout_id IS NULL",
        (rollout_id, env_id),
    )
