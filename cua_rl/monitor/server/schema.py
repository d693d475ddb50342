"""The Training Monitor's database schema, as versioned migrations.

Migration 1 creates the 13 tables of the seed schema exactly (columns, types, defaults,
constraints), its 25 indexes, and what the seed leaves to "the application layer or triggers",
enforced by the database itself: status vocabularies as CHECK constraints, the rollout source rule
as named CHECK constraints, status_history rows and ``updated_at`` written by triggers.

Two side tables keep the monitor's own bookkeeping out of the seed tables so they stay identical
to the seed: ``client_key`` maps ``(entity, client_id)`` to a row id (idempotent upserts and
references by client id), ``extra_field`` keeps fields a client sent that the schema does not name.
Later changes append a migration; a shipped migration is never edited. Migration 2 adds the
``screenshot`` table of the screenshot store. Migration 3 lets an environment exist before its
rollout (``environment.rollout_id`` nullable), as the existing clients record it
(cua_rl/monitor/server/compat.py); the only departure from the seed's columns. Migration 4 adds
``service_pause``; migration 5 the trajectory warehouse's ``episode_store`` and ``episode_image``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cua_rl.monitor.protocol import STATUSES

# The status vocabularies and rollout sources live in the protocol both sides share.

# Tables that carry an ``updated_at`` column maintained by a trigger.
UPDATED_AT_TABLES = ("training", "baseline", "eval", "task", "step", "rollout", "environment")

# The seed's 25 indexes: (name, table, columns).
SEED_INDEXES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("idx_training_run_name", "training", ("run_name",)),
    ("idx_training_status", "training", ("status",)),
    ("idx_training_status_heartbeat", "training", ("status", "last_heartbeat")),
    ("idx_baseline_training_id", "baseline", ("training_id",)),
    ("idx_baseline_status", "baseline", ("status",)),
    ("idx_eval_training_step", "eval", ("training_id", "step")),
    ("idx_eval_status", "eval", ("status",)),
    ("idx_task_task_id", "task", ("task_id",)),
    ("idx_validator_task_id", "validator", ("task_id",)),
    ("idx_step_training_step", "step", ("training_id", "step")),
    ("idx_step_status", "step", ("status",)),
    ("idx_rollout_source_step", "rollout", ("source_type", "step_id")),
    ("idx_rollout_source_eval", "rollout", ("source_type", "eval_id")),
    ("idx_rollout_source_baseline", "rollout", ("source_type", "baseline_id")),
    ("idx_rollout_task_id", "rollout", ("task_id",)),
    ("idx_rollout_rollout_id", "rollout", ("rollout_id",)),
    ("idx_rollout_status", "rollout", ("status",)),
    ("idx_turn_rollout_turn", "turn", ("rollout_id", "turn")),
    ("idx_action_turn_id", "action", ("turn_id",)),
    ("idx_obs_turn_id", "obs", ("turn_id",)),
    ("idx_validation_rollout_id", "validation", ("rollout_id",)),
    ("idx_environment_rollout_id", "environment", ("rollout_id",)),
    ("idx_environment_status", "environment", ("status",)),
    ("idx_status_history_entity", "status_history", ("entity_type", "entity_id")),
    (
        "idx_status_history_entity_time",
        "status_history",
        ("entity_type", "entity_id", "changed_at"),
    ),
)

SEED_TABLES = (
    "training",
    "baseline",
    "eval",
    "task",
    "validator",
    "step",
    "rollout",
    "turn",
    "action",
    "obs",
    "validation",
    "environment",
    "status_history",
)

# The columns a baseline and an evaluation share (both evaluate a model on the eval tasks).
_EVALUATION_COLUMNS = """\
    progress_percent REAL DEFAULT 0.0,
    current_task_index INTEGER,
    total_tasks INTEGER,
    completed_tasks INTEGER,
    current_phase TEXT,
    status_message TEXT,
    error_message TEXT,
    start_time TIMESTAMP,
    end_time TIMESTAMP,
    eval_time TIMESTAMP,
    success_rate REAL,
    avg_reward REAL,
    avg_turns REAL,
    successful_tasks INTEGER,
    metrics_json TEXT,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
    updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP"""

_TABLES_SQL = """
CREATE TABLE training (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_name TEXT NOT NULL UNIQUE,
    log_path TEXT NOT NULL,
    model_name TEXT NOT NULL,
    lora_rank INTEGER,
    learning_rate REAL,
    batch_size INTEGER,
    group_size INTEGER,
    groups_per_batch INTEGER,
    max_tokens INTEGER,
    temperature REAL,
    kl_penalty_coef REAL,
    num_substeps INTEGER,
    max_turns INTEGER,
    seed INTEGER,
    box_type TEXT,
    renderer_name TEXT,
    wandb_project TEXT,
    wandb_name TEXT,
    status TEXT DEFAULT 'pending'
        CONSTRAINT status_vocabulary CHECK (status IS NOT NULL AND status IN ({training})),
    progress_percent REAL DEFAULT 0.0,
    current_step INTEGER,
    total_steps INTEGER,
    current_phase TEXT,
    status_message TEXT,
    error_message TEXT,
    start_time TIMESTAMP,
    end_time TIMESTAMP,
    last_heartbeat TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
    config_json TEXT,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
    updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
);
CREATE TABLE baseline (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    training_id INTEGER NOT NULL REFERENCES training(id),
    model_path TEXT NOT NULL,
    status TEXT DEFAULT 'pending'
        CONSTRAINT status_vocabulary CHECK (status IS NOT NULL AND status IN ({baseline})),
{evaluation_columns}
);
CREATE TABLE eval (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    training_id INTEGER NOT NULL REFERENCES training(id),
    step INTEGER NOT NULL,
    model_path TEXT NOT NULL,
    status TEXT DEFAULT 'pending'
        CONSTRAINT status_vocabulary CHECK (status IS NOT NULL AND status IN ({baseline})),
{evaluation_columns},
    UNIQUE(training_id, step)
);
CREATE TABLE task (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    description TEXT NOT NULL,
    difficulty TEXT,
    category TEXT,
    max_steps INTEGER,
    validation_type TEXT,
    validation_query TEXT,
    expected_result TEXT,
    tags TEXT,
    prerequisites TEXT,
    app_name TEXT,
    source_type TEXT,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
    updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
);
CREATE TABLE validator (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id INTEGER NOT NULL REFERENCES task(id),
    validator_type TEXT NOT NULL,
    validation_query TEXT,
    validation_method TEXT,
    config_json TEXT,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
);
CREATE TABLE step (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    training_id INTEGER NOT NULL REFERENCES training(id),
    step INTEGER NOT NULL,
    batch INTEGER,
    status TEXT DEFAULT 'pending'
        CONSTRAINT status_vocabulary CHECK (status IS NOT NULL AND status IN ({step})),
    progress_percent REAL DEFAULT 0.0,
    current_phase TEXT,
    rollout_progress TEXT,
    training_progress TEXT,
    status_message TEXT,
    error_message TEXT,
    start_time TIMESTAMP,
    end_time TIMESTAMP,
    rollout_start_time TIMESTAMP,
    rollout_end_time TIMESTAMP,
    training_start_time TIMESTAMP,
    training_end_time TIMESTAMP,
    learning_rate REAL,
    model_path TEXT,
    checkpoint_path TEXT,
    loss REAL,
    kl_divergence REAL,
    policy_gradient_norm REAL,
    reward_mean REAL,
    reward_std REAL,
    num_trajectories INTEGER,
    num_tokens INTEGER,
    metrics_json TEXT,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
    updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
    UNIQUE(training_id, step)
);
CREATE TABLE rollout (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    source_type TEXT NOT NULL,
    step_id INTEGER REFERENCES step(id),
    eval_id INTEGER REFERENCES eval(id),
    baseline_id INTEGER REFERENCES baseline(id),
    rollout_id TEXT NOT NULL UNIQUE,
    batch INTEGER,
    "group" INTEGER,
    env_index INTEGER,
    task_id INTEGER NOT NULL REFERENCES task(id),
    model_path TEXT NOT NULL,
    is_eval INTEGER DEFAULT 0,
    status TEXT DEFAULT 'pending'
        CONSTRAINT status_vocabulary CHECK (status IS NOT NULL AND status IN ({rollout})),
    progress_percent REAL DEFAULT 0.0,
    current_phase TEXT,
    current_turn INTEGER,
    status_message TEXT,
    error_message TEXT,
    start_time TIMESTAMP,
    end_time TIMESTAMP,
    env_creation_time TIMESTAMP,
    agent_init_time TIMESTAMP,
    task_start_time TIMESTAMP,
    task_end_time TIMESTAMP,
    validation_time TIMESTAMP,
    rollout_time REAL,
    task_completed INTEGER,
    task_success INTEGER,
    agent_reported_success INTEGER,
    validation_passed INTEGER,
    num_turns INTEGER,
    max_turns INTEGER,
    reward REAL,
    temperature REAL,
    num_total_actions INTEGER,
    consecutive_repeated_actions INTEGER,
    parse_errors INTEGER,
    tool_name_errors INTEGER,
    tool_arg_errors INTEGER,
    runtime_errors INTEGER,
    ran_out_of_turns INTEGER,
    attempted_completion INTEGER,
    turn_first_success INTEGER,
    turn_task_completed INTEGER,
    errors TEXT,
    summary_json TEXT,
    trajectory_path TEXT,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
    updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
    CONSTRAINT source_type_vocabulary CHECK (source_type IN ('step', 'eval', 'baseline')),
    CONSTRAINT source_exactly_one_id
        CHECK ((step_id IS NOT NULL) + (eval_id IS NOT NULL) + (baseline_id IS NOT NULL) = 1),
    CONSTRAINT source_id_matches_type CHECK (
        (source_type = 'step' AND step_id IS NOT NULL)
        OR (source_type = 'eval' AND eval_id IS NOT NULL)
        OR (source_type = 'baseline' AND baseline_id IS NOT NULL)
    )
);
CREATE TABLE turn (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id INTEGER NOT NULL REFERENCES rollout(id),
    turn INTEGER NOT NULL,
    start_time TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
    end_time TIMESTAMP,
    turn_time REAL,
    reward REAL,
    episode_done INTEGER,
    model_response TEXT,
    metrics_json TEXT,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
    UNIQUE(rollout_id, turn)
);
CREATE TABLE action (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    turn_id INTEGER NOT NULL REFERENCES turn(id),
    action_type TEXT,
    tool_name TEXT,
    tool_args TEXT,
    tokens TEXT,
    logprobs TEXT,
    num_tokens INTEGER,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
);
CREATE TABLE obs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    turn_id INTEGER NOT NULL REFERENCES turn(id),
    obs_type TEXT,
    screenshot_uri TEXT,
    text_content TEXT,
    model_input_json TEXT,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
);
CREATE TABLE validation (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id INTEGER NOT NULL REFERENCES rollout(id),
    validator_id INTEGER REFERENCES validator(id),
    validation_time TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
    validation_query TEXT,
    expected_result TEXT,
    actual_result TEXT,
    success INTEGER NOT NULL,
    execution_time REAL,
    error_message TEXT,
    details_json TEXT,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
);
CREATE TABLE environment (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id INTEGER NOT NULL REFERENCES rollout(id),
    env_type TEXT NOT NULL,
    status TEXT DEFAULT 'pending'
        CONSTRAINT status_vocabulary CHECK (status IS NOT NULL AND status IN ({environment})),
    gbox_id TEXT,
    box_type TEXT,
    creation_time TIMESTAMP,
    termination_time TIMESTAMP,
    status_message TEXT,
    error_message TEXT,
    config_json TEXT,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
    updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
);
CREATE TABLE status_history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    entity_type TEXT NOT NULL,
    entity_id INTEGER NOT NULL,
    old_status TEXT,
    new_status TEXT NOT NULL,
    progress_percent REAL,
    status_message TEXT,
    metadata_json TEXT,
    changed_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
);
""".replace("{evaluation_columns}", _EVALUATION_COLUMNS)


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


def _status_history_triggers(tables: tuple[str, ...] = tuple(STATUSES)) -> str:
    parts = []
    for table in tables:
        # environment has no progress_percent column; its history rows carry NULL there.
        progress = "NULL" if table == "environment" else "NEW.progress_percent"
        insert = (
            "INSERT INTO status_history (entity_type, entity_id, old_status, new_status, "
            "progress_percent, status_message, changed_at) "
            f"VALUES ('{table}', NEW.id, {{old}}, NEW.status, {progress}, NEW.status_message, "
            "strftime('%Y-%m-%d %H:%M:%f', 'now'));"
        )
        parts.append(
            f"CREATE TRIGGER trg_{table}_status_insert AFTER INSERT ON {table}\n"
            f"BEGIN {insert.format(old='NULL')} END;"
        )
        parts.append(
            f"CREATE TRIGGER trg_{table}_status_update AFTER UPDATE OF status ON {table}\n"
            f"WHEN OLD.status IS NOT NEW.status\n"
            f"BEGIN {insert.format(old='OLD.status')} END;"
        )
    return "\n".join(parts)


def _updated_at_triggers(tables: tuple[str, ...] = UPDATED_AT_TABLES) -> str:
    # Fires only when the writer did not set updated_at itself; recursive triggers are off, so
    # the inner UPDATE does not fire this trigger again (and it does not touch status).
    return "\n".join(
        f"CREATE TRIGGER trg_{t}_updated_at AFTER UPDATE ON {t}\n"
        f"WHEN NEW.updated_at IS OLD.updated_at\n"
        f"BEGIN UPDATE {t} SET updated_at = CURRENT_TIMESTAMP WHERE id = NEW.id; END;"
        for t in tables
    )


_SIDE_TABLES_SQL = """
CREATE TABLE client_key (
    entity_type TEXT NOT NULL,
    client_id TEXT NOT NULL,
    entity_id INTEGER NOT NULL,
    PRIMARY KEY (entity_type, client_id)
) WITHOUT ROWID;
CREATE INDEX idx_client_key_entity ON client_key (entity_type, entity_id);
CREATE TABLE extra_field (
    entity_type TEXT NOT NULL,
    entity_id INTEGER NOT NULL,
    fields_json TEXT NOT NULL,
    PRIMARY KEY (entity_type, entity_id)
) WITHOUT ROWID;
"""


def _migration_1() -> str:
    tables = _TABLES_SQL.format(**{t: _quoted(v) for t, v in STATUSES.items()})
    indexes = "\n".join(
        f"CREATE INDEX {name} ON {table} ({', '.join(cols)});" for name, table, cols in SEED_INDEXES
    )
    return "\n".join(
        [tables, indexes, _status_history_triggers(), _updated_at_triggers(), _SIDE_TABLES_SQL]
    )


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


# Migration 2: the screenshot store's index (cua_rl/monitor/server/screenshots.py). The image bytes live
# in files beside the database; this table is what retention orders by, and what the store
# answers "already stored" from.
_SCREENSHOT_SQL = """
CREATE TABLE screenshot (
    sha256 TEXT PRIMARY KEY,
    mime TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    width INTEGER,
    height INTEGER,
    created_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP
);
CREATE INDEX idx_screenshot_created ON screenshot (created_at);
"""


def _migration_3() -> str:
    """``environment.rollout_id`` loses NOT NULL, everything else of the table stays.

    SQLite cannot drop a column constraint in place, so this is its documented table
    redefinition, inside the migration's transaction: a copy of migration 1's table with the one
    constraint relaxed, the rows copied with their ids (status_history, client_key and
    extra_field refer to them), the AUTOINCREMENT counter carried over, the old table dropped
    (no table references environment, so foreign keys allow it), the copy renamed, and the
    table's indexes and triggers created again."""
    seed = _TABLES_SQL.format(**{t: _quoted(v) for t, v in STATUSES.items()})
    found = re.search(r"^CREATE TABLE environment \(\n.*?^\);$", seed, flags=re.M | re.S)
    if found is None:
        raise RuntimeError("migration 1 has no environment table")
    required = "rollout_id INTEGER NOT NULL REFERENCES rollout(id)"
    if required not in found.group(0):
        raise RuntimeError("migration 1's environment.rollout_id is not the expected column")
    table = found.group(0).replace("CREATE TABLE environment (", "CREATE TABLE environment_v3 (")
    table = table.replace(required, "rollout_id INTEGER REFERENCES rollout(id)")
    indexes = "\n".join(
        f"CREATE INDEX {name} ON {t} ({', '.join(cols)});"
        for name, t, cols in SEED_INDEXES
        if t == "environment"
    )
    return "\n".join(
        [
            table,
            "INSERT INTO environment_v3 SELECT * FROM environment;",
            "INSERT INTO sqlite_sequence (name, seq) SELECT 'environment_v3', seq "
            "FROM sqlite_sequence WHERE name = 'environment' "
            "AND NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'environment_v3');",
            "UPDATE sqlite_sequence SET seq = MAX(seq, (SELECT COALESCE(MAX(seq), 0) "
            "FROM sqlite_sequence WHERE name = 'environment')) WHERE name = 'environment_v3';",
            "DROP TABLE environment;",
            "ALTER TABLE environment_v3 RENAME TO environment;",
            indexes,
            _status_history_triggers(("environment",)),
            _updated_at_triggers(("environment",)),
        ]
    )


# Migration 4: one row per service pause of a training (cua_rl/rollout/service_pauses.py): which
# service failed, why, when new episodes stopped and when they started again, how many probes
# failed.
_PAUSE_SQL = """
CREATE TABLE service_pause (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    training_id INTEGER NOT NULL REFERENCES training(id),
    service TEXT NOT NULL,
    reason TEXT,
    error_message TEXT,
    phase TEXT,
    worker TEXT,
    start_time TIMESTAMP NOT NULL,
    end_time TIMESTAMP,
    duration_s REAL,
    probes INTEGER DEFAULT 0,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
    updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
);
CREATE INDEX idx_service_pause_training ON service_pause (training_id, start_time);
""" + _updated_at_triggers(("service_pause",))


# Migration 5: the trajectory warehouse (cua_rl/warehouse, docs/warehouse.md). One row per stored
# episode: its token data as one zlib blob and its rows' metadata as JSON; ``episode_image`` names
# the screenshot-store images each one needs, so retention never drops them.
_EPISODE_STORE_SQL = """
CREATE TABLE episode_store (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    client_id TEXT NOT NULL UNIQUE,
    rollout_id INTEGER NOT NULL UNIQUE REFERENCES rollout(id),
    training_id INTEGER REFERENCES training(id),
    task_id TEXT NOT NULL,
    episode_id INTEGER NOT NULL,
    reward REAL NOT NULL,
    success INTEGER NOT NULL,
    version_min INTEGER NOT NULL,
    version_max INTEGER NOT NULL,
    format INTEGER NOT NULL,
    n_rows INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    rows_json TEXT NOT NULL,
    turns_json TEXT NOT NULL,
    data BLOB NOT NULL,
    bytes INTEGER NOT NULL,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
);
CREATE INDEX idx_episode_store_task ON episode_store (task_id, success, version_min);
CREATE INDEX idx_episode_store_training ON episode_store (training_id, id);
CREATE TABLE episode_image (
    episode_store_id INTEGER NOT NULL REFERENCES episode_store(id) ON DELETE CASCADE,
    sha256 TEXT NOT NULL,
    PRIMARY KEY (episode_store_id, sha256)
);
CREATE INDEX idx_episode_image_sha256 ON episode_image (sha256);
"""
EPISODE_STORE_VERSION = 5


# Migration 6: verifier audits (cua_rl/audit, docs/audit.md). One row per audit (its gym, status,
# progress and counts per verdict) and one per audited task (its verdict, the flags with their
# evidence, the rewarded runs per agent, every run as JSON).
_AUDIT_SQL = """
CREATE TABLE audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    client_id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL DEFAULT 'running'
        CHECK (status IN ('running', 'completed', 'cancelled', 'failed')),
    gym_base_url TEXT NOT NULL DEFAULT '',
    gym_id TEXT NOT NULL DEFAULT '',
    config_path TEXT NOT NULL DEFAULT '',
    tasks_total INTEGER NOT NULL DEFAULT 0,
    tasks_done INTEGER NOT NULL DEFAULT 0,
    flagged INTEGER NOT NULL DEFAULT 0,
    counts_json TEXT,
    settings_json TEXT,
    executions_json TEXT,
    message TEXT,
    started_at TIMESTAMP,
    finished_at TIMESTAMP,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
    updated_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
);
CREATE INDEX idx_audit_gym ON audit (gym_id, id);
CREATE TABLE audit_task (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    audit_id INTEGER NOT NULL REFERENCES audit(id) ON DELETE CASCADE,
    task_id TEXT NOT NULL,
    name TEXT NOT NULL DEFAULT '',
    verdict TEXT NOT NULL
        CHECK (verdict IN ('free_reward', 'rejects_success', 'flaky', 'clean', 'unchecked')),
    flags_json TEXT,
    summary_json TEXT,
    skipped_json TEXT,
    runs_json TEXT,
    seconds REAL,
    created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP,
    UNIQUE (audit_id, task_id)
);
""" + _updated_at_triggers(("audit",))
AUDIT_VERSION = 6

# Migration 7: the batches applied under an idempotency key (the ``Idempotency-Key`` header,
# which this package's client sends with every queued batch, the same on every resend and
# replay). A batch whose key is here is not applied again: replaying one that holds several
# status changes of one record would walk that record back through them.
_APPLIED_BATCH_SQL = """
CREATE TABLE applied_batch (
    batch_key TEXT PRIMARY KEY,
    applied_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP
);
"""
APPLIED_BATCH_VERSION = 7


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "seed schema", _migration_1()),
    Migration(2, "screenshot store", _SCREENSHOT_SQL),
    Migration(3, "environment before its rollout", _migration_3()),
    Migration(4, "service pauses", _PAUSE_SQL),
    Migration(EPISODE_STORE_VERSION, "trajectory warehouse", _EPISODE_STORE_SQL),
    Migration(AUDIT_VERSION, "verifier audits", _AUDIT_SQL),
    Migration(APPLIED_BATCH_VERSION, "idempotency keys of applied batches", _APPLIED_BATCH_SQL),
)
