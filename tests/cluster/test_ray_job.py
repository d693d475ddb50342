"""The trainer's side of a Ray job: what it passes the workers, and a clear error without a
cluster."""

from __future__ import annotations

import pytest

from cua_rl.areal import ray_job
from cua_rl.errors import ConfigError


def test_the_workers_get_the_trainers_cua_variables_only():
    # The monitor's URL and token travel in the workflow settings, resolved by the trainer.
    environ = {
        "CUA_RL_LOG_LEVEL": "DEBUG",
        "MONITOR_BASE_URL": "http://monitor:8000",
        "MONITOR_PROJECT_TOKEN": "t",
        "LANG": "C.UTF-8",
        "CUDA_VISIBLE_DEVICES": "0",
        "XCUA_RL_NOT_OURS": "1",
    }
    assert ray_job.forwarded_env(environ) == {"CUA_RL_LOG_LEVEL": "DEBUG"}


def test_connecting_without_a_cluster_address_says_how_to_get_one(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="RAY_ADDRESS=host:port"):
        ray_job.connect()
