"""What both sides of the monitor agree on: record kinds, client id formats, status words.

The worker side (``cua_rl.monitor.worker``) builds batches and ids with these names and the
server side (``cua_rl.monitor.server``) validates, derives and resolves them, so each format lives
in one place. A batch is a JSON object whose keys are :data:`RECORD_KINDS`, applied in that order
(a record may reference one listed before it). Steps, evals and baselines are identified by their
training (the run name on the worker side, the server id when the server derives an id), the step
and a batch number; records of one rollout by the rollout's uuid. Nothing here imports either
side, so the training process never loads the server's code.
"""

from __future__ import annotations

import re
from typing import Any

from cua_rl.core.images import sniff_mime  # noqa: F401  (the store's image types)
from cua_rl.errors import CuaRlError

# Batch key -> table, in dependency order: a record may only reference kinds listed before it.
RECORD_TABLES: dict[str, str] = {
    "training": "training",
    "tasks": "task",
    "validators": "validator",
    "steps": "step",
    "baselines": "baseline",
    "evals": "eval",
    "pauses": "service_pause",
    "rollouts": "rollout",
    "environments": "environment",
    "turns": "turn",
    "actions": "action",
    "observations": "obs",
    "validations": "validation",
}
RECORD_KINDS: tuple[str, ...] = tuple(RECORD_TABLES)
# The header naming a batch's idempotency key: a batch whose key the monitor applied before is
# not applied again. This package's client gives each queued batch one key, the same on every
# resend and replay (the server's ``applied_batch`` table).
BATCH_KEY_HEADER = "Idempotency-Key"
MAX_BATCH_KEY_CHARS = 200
# The trajectory warehouse's kinds (cua_rl.warehouse, docs/warehouse.md): ``episode_images`` (the
# bytes the model received, by sha256) are stored before every other kind of their batch, and
# ``episodes`` (an accepted episode's token data) after them all, since it names its rollout.
IMAGE_KIND = "episode_images"
EPISODE_KIND = "episodes"
# Verifier audits (cua_rl/audit, docs/audit.md): an audit's record (updated as it runs), then its
# tasks' verdicts, which name their audit by client id. They reference no training.
AUDIT_KIND = "audits"
AUDIT_TASK_KIND = "audit_tasks"
AUDIT_KINDS: tuple[str, ...] = (AUDIT_KIND, AUDIT_TASK_KIND)
AUDIT_STATUSES = ("running", "completed", "cancelled", "failed")
# A task's verdict: the flags first, in the order a task's verdict names the first it has.
AUDIT_FLAGS = ("free_reward", "rejects_success", "flaky")
AUDIT_VERDICTS = (*AUDIT_FLAGS, "clean", "unchecked")
AUDIT_LABELS = {
    "free_reward": "free reward",
    "rejects_success": "rejects its own success",
    "flaky": "flaky",
    "clean": "clean",
    "unchecked": "unchecked",
}
BATCH_ORDER: tuple[str, ...] = (IMAGE_KIND, *RECORD_KINDS, EPISODE_KIND, *AUDIT_KINDS)

# The status words the worker side writes, by name (each is a word of STATUSES below).
PENDING = "pending"
RUNNING = "running"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
ROLLOUT_RUNNING = "rollout_running"

# The status words of each stateful table (the seed schema's vocabularies).
STATUSES: dict[str, tuple[str, ...]] = {
    "training": (
        "pending",
        "initializing",
        "running",
        "completed",
        "failed",
        "paused",
        "cancelled",
    ),
    "baseline": ("pending", "running", "completed", "failed", "cancelled"),
    "eval": ("pending", "running", "completed", "failed", "cancelled"),
    "step": ("pending", "rollout_collecting", "rollout_running", "training", "completed", "failed"),
    "rollout": (
        "pending",
        "env_creation",
        "agent_init",
        "running",
        "completed",
        "failed",
        "cancelled",
    ),
    "environment": ("pending", "creating", "running", "terminated", "error"),
}
# The words after which a record does not change any more.
TERMINAL: dict[str, frozenset[str]] = {
    "training": frozenset({"completed", "failed", "cancelled"}),
    "baseline": frozenset({"completed", "failed", "cancelled"}),
    "eval": frozenset({"completed", "failed", "cancelled"}),
    "step": frozenset({"completed", "failed"}),
    "rollout": frozenset({"completed", "failed", "cancelled"}),
    "environment": frozenset({"terminated", "error"}),
}

# Where a rollout comes from, and the column naming that source.
SOURCE_TYPES = ("step", "eval", "baseline")
SOURCE_ID_COLUMNS = {"step": "step_id", "eval": "eval_id", "baseline": "baseline_id"}


def step_client_id(training: int | str, step: int, batch: int = 0) -> str:
    return f"step-{training}-{step}-{batch}"


def eval_client_id(training: int | str, step: int) -> str:
    return f"eval-{training}-{step}"


def baseline_client_id(training: int | str, suffix: str | int = 0) -> str:
    return f"baseline-{training}-{suffix}"


def pause_client_id(training: int | str, service: str, started: float, worker: str) -> str:
    """A service pause of one worker: its training, the service, the start (epoch seconds)."""
    return f"pause-{training}-{service}-{worker}-{started:.3f}"


def environment_client_id(rollout_uuid: str) -> str:
    return f"{rollout_uuid}:env"


def turn_client_id(rollout_uuid: str, turn: int) -> str:
    return f"{rollout_uuid}:turn:{turn}"


def action_client_id(rollout_uuid: str, turn: int, index: int) -> str:
    return f"{turn_client_id(rollout_uuid, turn)}:action:{index}"


def observation_client_id(rollout_uuid: str, turn: int, index: int) -> str:
    return f"{turn_client_id(rollout_uuid, turn)}:obs:{index}"


def validation_client_id(rollout_uuid: str) -> str:
    return f"{rollout_uuid}:validation"


def natural_client_id(table: str, values: dict[str, Any], rollout_uuid: str | None) -> str | None:
    """The client id a record sent without one gets from its natural key (the formats above,
    with the server's ids); None when it has none. ``rollout_uuid`` is the uuid of the rollout
    ``values["rollout_id"]`` names, for environments and turns."""
    if table == "training":
        return values.get("run_name") or None
    if table in ("task", "rollout"):
        return values.get(f"{table}_id") or None
    training, step = values.get("training_id"), values.get("step")
    if table in ("step", "eval") and training is not None and step is not None:
        if table == "eval":
            return eval_client_id(training, step)
        return step_client_id(training, step, values.get("batch") or 0)
    if table in ("turn", "environment") and values.get("rollout_id") is not None:
        if table == "environment":
            return environment_client_id(str(rollout_uuid))
        if values.get("turn") is not None:
            return turn_client_id(str(rollout_uuid), values["turn"])
    return None


# ---------------------------------------------------------------------------- screenshots
# Observations name stored images ``sha256:<hex>``; the upload goes to PUT /api/screenshots/<hex>.

URI_PREFIX = "sha256:"
HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def screenshot_uri(sha256: str) -> str:
    return f"{URI_PREFIX}{sha256}"


def parse_screenshot_uri(uri: Any) -> str | None:
    """The hash of a ``sha256:<hex>`` reference; None for anything else (an URL, a note)."""
    if isinstance(uri, str) and uri.startswith(URI_PREFIX):
        digest = uri[len(URI_PREFIX) :]
        if HEX_DIGEST.match(digest):
            return digest
    return None


class ScreenshotError(CuaRlError, ValueError):
    """An image was refused; ``code`` is stable (``not_an_image``, ``too_large``, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
