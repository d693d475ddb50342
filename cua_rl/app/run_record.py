"""One monitor record per run: the name a training is recorded under.

The monitor upserts a training by its run name (``monitor.run_name``, default
``{experiment_name}-{trial_name}``), and the shipped configs fix both names, so a second run
would reopen the first one's record (status back to running, a new start time, colliding step
ids). Before the first record, the launcher asks the monitor whether the name is taken
(``GET /api/task-outcomes?run_name=``, whose ``training_id`` is null for an unknown run):

* not taken: the run uses the name;
* taken and ``recover.mode`` is on/auto (AReaL resumes from its checkpoint): the run continues
  that record;
* taken otherwise: the run is recorded as ``{name}-2`` (the first free ``-N``), said in the log.

A monitor that cannot answer leaves the name as it is, with a warning: its records spool.

``record_fields`` gives the training record's columns that are read off the config rather than
a generic one (LoRA rank, groups per batch, box type, the W&B run's project and name as AReaL's
``StatsLogger`` names it).
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from cua_rl.errors import ConfigError, MonitorError
from cua_rl.logs import get_logger

log = get_logger(__name__)

RESUMING_MODES = ("on", "auto")
BOX_OF_ACTION_SPACE = {"mobile": "android", "pc": "linux"}
MAX_SUFFIX = 1000


def choose_run_name(base: str, recover_mode: str, taken: Callable[[str], bool]) -> tuple[str, str]:
    """``(name, why)``: the name this run is recorded under and a line saying why."""
    if not taken(base):
        return base, f"recorded as {base!r}"
    if recover_mode in RESUMING_MODES:
        return base, f"continues the record {base!r} (recover.mode={recover_mode})"
    for n in range(2, MAX_SUFFIX):
        name = f"{base}-{n}"
        if not taken(name):
            return name, (
                f"a training {base!r} is already recorded: this run is recorded as {name!r} "
                f"(set recover.mode=auto to continue it, or monitor.run_name to name the run)"
            )
    raise ConfigError(
        f"{MAX_SUFFIX} trainings named {base}-N are recorded: set monitor.run_name to a new name"
    )


def monitor_lookup(base_url: str, token: str | None, timeout_s: float = 10.0):
    """``taken(name)`` over the monitor's HTTP API; raises MonitorError when it cannot answer."""
    url = f"{base_url.rstrip('/')}/api/task-outcomes"
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    def taken(name: str) -> bool:
        try:
            resp = httpx.get(url, params={"run_name": name}, headers=headers, timeout=timeout_s)
            resp.raise_for_status()
            return resp.json().get("training_id") is not None
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise MonitorError(f"{url}: {type(exc).__name__}: {exc}") from None

    return taken


def claim_run_name(config, base_url: str, token: str | None) -> str:
    """Set ``config.monitor.run_name`` to the name this run is recorded under, and return it."""
    base = config.run_name
    if not base_url:
        return base
    try:
        name, why = choose_run_name(base, config.recover.mode, monitor_lookup(base_url, token))
    except MonitorError as exc:
        log.warning("monitor: could not ask whether %r is recorded (%s); using it", base, exc)
        return base
    print(f"monitor: {why}", flush=True)
    config.monitor.run_name = name
    return name


def record_fields(config) -> dict:
    """The training record's run-specific columns; None where the run has no such thing."""
    actor, stats = config.actor, config.stats_logger
    wandb = stats.wandb.mode != "disabled"
    return {
        "lora_rank": actor.lora_rank if actor.use_lora else None,
        "groups_per_batch": config.train_dataset.batch_size,  # a group per task of the batch
        "num_substeps": actor.ppo_n_minibatches,  # optimizer steps per batch
        "box_type": config.gym.box_type or BOX_OF_ACTION_SPACE[config.agent.action_space],
        # AReaL's StatsLogger: wandb.init(project=... or experiment_name, name=... or trial_name)
        "wandb_project": (stats.wandb.project or stats.experiment_name) if wandb else None,
        "wandb_name": (stats.wandb.name or stats.trial_name) if wandb else None,
    }
