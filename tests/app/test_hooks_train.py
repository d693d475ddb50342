"""Whole trainings with a user's workflow subclass (``workflow=`` in the config), as a project runs
one: train.py on configs/local.yaml, AReaL's PPOTrainer, a vLLM CPU server, the local gym and
agent, the monitor on SQLite. A subclass that overrides only the reward trains on its reward (the
session's shared service-current training runs under one: tests/conftest.py ``SERVICE_CURRENT``);
a hook that raises on every episode stops the training through failfast, its one line naming the
hook and the exception (before, the exception escaped each episode into AReaL's executor, which
drew another task forever): a training of its own, borrowing the process's shared server of the
BPE tiny model (``model_servers``; scripts/test_shards.py runs these tests in the process that
holds it and trains the shared ones)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from cua_rl.sim.agent import AgentServer
from cua_rl.sim.gym import GymServer
from tests.app import workflows
from tests.conftest import SERVICE_CURRENT, note_cost, train_command
from tests.conftest import db_rows as _rows

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


MODEL = "qwen2-vl-bpe"


def _train(
    name: str, tmp_path: Path, servers, warm_env, gym, agent, *overrides: str, timeout: int = 800
):
    server = servers(MODEL)
    monitor = f"monitor.db_path={tmp_path / 'monitor.db'}"
    argv = train_command(
        server.model_dir, gym.url, agent.url, monitor, tmp_path, *overrides,
        server.borrow_override(),
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        return subprocess.run(
            argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
            env={**os.environ, **warm_env},
        )  # fmt: skip
    finally:
        note_cost(name, time.monotonic() - t0)


@pytest.mark.timeout(900)
def test_a_hook_that_always_raises_stops_the_training_through_failfast_naming_it(
    tmp_path, model_servers, warm_env
):
    window = 6
    where = "tests.app.workflows.BrokenReward.compute_reward"
    with GymServer() as gym, AgentServer() as agent:
        t0 = time.monotonic()
        proc = _train(
            "hooks: a raising hook", tmp_path, model_servers, warm_env, gym, agent,
            f"workflow={workflows.BrokenReward.__module__}.BrokenReward",
            f"failfast.window={window}",
            # Above local.yaml's 4 episodes in flight: a count is allowed to trip at once.
            "failfast.persist_s=0",
            "total_train_steps=20",
            "total_train_epochs=20",
        )  # fmt: skip
        took = time.monotonic() - t0
        left_open = httpx.get(f"{gym.base_url}/executions", timeout=10).json()["executions"]
    assert left_open == [], left_open
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("training failed: ")]
    assert "'hook_compute_reward'" in line, line
    assert f"ZeroDivisionError: the reward's bug (raised by {where})" in line, line
    db = tmp_path / "monitor.db"
    status, err = _rows(db, "SELECT status, error_message FROM training")[0]
    assert status == "failed" and "hook_compute_reward" in err and where in err, (status, err)
    rejected = _rows(
        db, "SELECT status_message, COUNT(*) FROM rollout WHERE status = 'failed' GROUP BY 1"
    )
    assert [r for r, _ in rejected] == ["hook_compute_reward"], rejected
    # Stopped within the window: the rejections that tripped it, plus at most the episodes
    # already running when it did (4 groups of 2) and those ending during one poll and the stop.
    assert window <= rejected[0][1] <= window + 2 * 4 * 2, rejected
    print(f"stopped after {took:.0f}s and {rejected[0][1]} rejected episodes: {line}")


@pytest.mark.timeout(1600)
def test_a_workflow_that_overrides_only_the_reward_trains(shared_training):
    # The session's service-current training runs under the subclass (tests/conftest.py
    # SERVICE_CURRENT); its conversion and training are checked by app/test_context_train.py.
    run = shared_training(SERVICE_CURRENT.name)
    assert (
        f"workflow={workflows.RewardPlusBonus.__module__}.RewardPlusBonus" in SERVICE_CURRENT.args
    )
    assert run.returncode == 0, run.output[-3000:]
    ((status, config),) = _rows(run.db, "SELECT status, config_json FROM training")
    assert status == "completed"
    assert json.loads(config)["workflow"] == "tests.app.workflows.RewardPlusBonus", config[:2000]
    steps = _rows(run.db, "SELECT step, status FROM step ORDER BY step")
    assert steps == [(n, "completed") for n in range(1, SERVICE_CURRENT.steps + 1)], steps
    rewards = [r for (r,) in _rows(run.db, "SELECT reward FROM rollout WHERE status = 'completed'")]
    # Every episode credited by the subclass's hook (the gym and the shaping give at most 1).
    assert rewards and all(r >= workflows.BONUS - 1.0 for r in rewards), rewards
    print(f"{len(rewards)} episodes, rewards {sorted(rewards)}")
