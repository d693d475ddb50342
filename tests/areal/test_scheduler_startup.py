"""Each scheduler the trainer builds waits ``worker_startup_s`` for its workers, not AReaL's 30 s
(a forked eval-rollout worker on a busy node took longer, and the run ended at start-up)."""

from __future__ import annotations

from pathlib import Path

import pytest
from areal import PPOTrainer

from cua_rl.app.config import CUAConfig
from cua_rl.app.config_load import load_config
from cua_rl.areal.actor import with_actor

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", ["local", "ray", "slurm"])
def test_the_scheduler_waits_the_configured_time(tmp_path, kind):
    config = load_config(
        [
            "--config",
            str(ROOT / "configs" / "local.yaml"),
            f"cluster.fileroot={tmp_path}",
            "actor.path=/models/unused",  # required at launch; nothing here loads it
            f"scheduler.type={kind}",
            "worker_startup_s=123",
        ],
        CUAConfig,
    )
    # The trainer's own method, on an instance that has only what it reads (its config).
    trainer = object.__new__(with_actor(PPOTrainer))
    trainer.config = config
    scheduler = trainer._init_scheduler()
    assert type(scheduler).__name__.lower().startswith(kind)
    assert scheduler.startup_timeout == 123


def test_the_default_is_longer_than_areals(tmp_path):
    config = load_config(
        [
            "--config",
            str(ROOT / "configs" / "local.yaml"),
            f"cluster.fileroot={tmp_path}",
            "actor.path=/models/unused",
        ],
        CUAConfig,
    )
    assert config.worker_startup_s == 300
