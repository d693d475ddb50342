"""The training's own records (training, steps, evals, baseline) reach a real monitor, and the
trainer hooks record phases without changing what the trainer does."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from cua_rl.areal.hooks import TrainerHooks
from cua_rl.monitor.worker.client import MonitorClientConfig
from cua_rl.monitor.worker.training import TrainingMonitor, step_fields
from cua_rl.serving import bind_free_port

RUN = "life-test"


def _tm(url: str, tmp_path) -> TrainingMonitor:
    cfg = MonitorClientConfig(base_url=url, spool_path=str(tmp_path / "spool.jsonl"))
    tm = TrainingMonitor(cfg, RUN)
    tm.start()
    return tm


class _Config:
    seed = 3

    class gconfig:  # noqa: N801 - mimics the config attribute
        n_samples = 2
        temperature = 1.0
        max_new_tokens = 24


def test_step_fields_from_areal_stats():
    stats = {
        "ppo_actor/update/actor_loss/avg": 0.25,
        "ppo_actor/update/grad_norm": 1.5,
        "ppo_actor/update/lr": 1e-4,
        "rollout/cua/reward": 0.5,
        "rollout/cua/reward_sq": 0.5,  # rewards of 0 and 1 -> std 0.5
        "ppo_actor/n_valid_tokens": 40.0,
        "ppo_actor/n_seqs": 4,
        "timeperf/rollout": float("nan"),
    }
    f = step_fields(stats)
    assert f["loss"] == 0.25
    assert f["policy_gradient_norm"] == 1.5
    assert f["learning_rate"] == 1e-4
    assert f["reward_mean"] == 0.5
    assert f["reward_std"] == pytest.approx(0.5)
    assert f["num_trajectories"] == 4
    assert f["num_tokens"] == 40


def test_training_lifecycle_records(monitor, tmp_path):
    tm = _tm(monitor.url, tmp_path)
    tm.training_started(config=_Config(), total_steps=2, log_path="logs")
    assert tm.tasks([{"task_id": "t1", "name": "one", "tags": ["easy"], "split": "train"}]) == 1
    tm.baseline_started(model_path="m", total_tasks=1)
    tm.baseline_finished({"eval-rollout/cua/success": 1.0, "eval-rollout/cua/reward": 1.0})
    tm.step_started(1, total_steps=2)
    tm.step_phase(1, "training", "training")
    tm.step_committed(
        1, {"rollout/cua/reward": 0.5, "ppo_actor/update/grad_norm": 2.0}, total_steps=2
    )
    tm.eval_started(1, model_path="m", total_tasks=1)
    tm.eval_finished(1, {"eval-rollout/cua/success": 0.0}, total_tasks=1)
    tm.step_started(2, total_steps=2)
    tm.training_failed(RuntimeError("boom"))
    assert tm.flush(20)
    tm.close()

    db = sqlite3.connect(monitor.db_path)
    status, err, step = db.execute(
        "SELECT status, error_message, current_step FROM training WHERE run_name = ?", (RUN,)
    ).fetchone()
    assert status == "failed" and "RuntimeError: boom" in err and step == 2
    steps = db.execute(
        "SELECT step, status, reward_mean, policy_gradient_norm FROM step ORDER BY step"
    ).fetchall()
    # The step the failure cut short is failed by the monitor's safety net with the training.
    assert steps == [(1, "completed", 0.5, 2.0), (2, "failed", None, None)]
    assert db.execute("SELECT status, success_rate FROM baseline").fetchall() == [
        ("completed", 1.0)
    ]
    assert db.execute(
        "SELECT step, status, success_rate, completed_tasks FROM eval"
    ).fetchall() == [(1, "completed", 0.0, 1)]
    # The database wrote the status history of each change.
    history = db.execute(
        "SELECT new_status FROM status_history WHERE entity_type = 'step' ORDER BY id"
    ).fetchall()
    assert ("training",) in history and ("completed",) in history
    db.close()


def test_a_step_counts_the_episodes_it_trained_not_its_rows(monitor, tmp_path):
    # 2 tasks x 2 samples, each episode 3 rows (an agent that re-renders its history).
    cfg = MonitorClientConfig(base_url=monitor.url, spool_path=str(tmp_path / "spool.jsonl"))
    tm = TrainingMonitor(cfg, RUN, episodes_per_step=4)
    tm.start()
    tm.training_started(config=_Config(), total_steps=1, log_path="logs")
    tm.step_started(1, total_steps=1)
    tm.step_committed(
        1, {"ppo_actor/n_seqs": 12.0, "ppo_actor/n_valid_tokens": 40.0}, total_steps=1
    )
    assert tm.flush(20)
    tm.close()
    db = sqlite3.connect(monitor.db_path)
    row = db.execute("SELECT num_trajectories, num_tokens, metrics_json FROM step").fetchone()
    db.close()
    assert row[:2] == (4, 40)
    assert json.loads(row[2])["ppo_actor/n_seqs"] == 12.0  # the rows stay in the step's metrics


def test_ctrl_c_marks_the_training_cancelled(monitor, tmp_path):
    tm = _tm(monitor.url, tmp_path)
    tm.training_started(config=_Config(), total_steps=2)
    tm.training_failed(KeyboardInterrupt())
    tm.training_finished()  # ignored: the first end wins
    assert tm.flush(20)
    tm.close()
    db = sqlite3.connect(monitor.db_path)
    assert db.execute("SELECT status FROM training").fetchone() == ("cancelled",)
    db.close()


def test_monitor_down_never_raises_and_spools(tmp_path):
    sock = bind_free_port()
    tm = _tm(f"http://127.0.0.1:{sock.getsockname()[1]}", tmp_path)
    tm.training_started(config=_Config(), total_steps=1)
    tm.step_started(1)
    tm.close(timeout=2)
    sock.close()
    assert (tmp_path / "spool.jsonl").read_text().count(RUN) >= 2


class _FakeStatsLogger:
    def __init__(self):
        self.commits = []

    def commit(self, epoch, step, global_step, data):
        self.commits.append((epoch, step, global_step, data))
        return "committed"


class _FakeActor:
    def __init__(self, fail: bool = False):
        self.calls = []
        self.fail = fail

    def ppo_update(self, batch):
        self.calls.append(("ppo_update", batch))
        if self.fail:
            raise RuntimeError("update failed")

    def update_weights(self, meta):
        self.calls.append(("update_weights", meta))


class _FakeTrainer:
    recover_info = None  # a fresh run

    def __init__(self, fail=False):
        self.stats_logger = _FakeStatsLogger()
        self.actor = _FakeActor(fail)
        self.evals = 0

    def _evaluate_fn(self, **kw):
        self.evals += 1


def test_hooks_pass_calls_through_and_record_phases(monitor, tmp_path):
    tm = _tm(monitor.url, tmp_path)
    tm.training_started(config=_Config(), total_steps=2)
    trainer = _FakeTrainer()
    hooks = TrainerHooks(tm, total_steps=2, model_path="m", eval_tasks=1)
    hooks.attach(trainer)
    trainer.actor.ppo_update(["row1", "row2", "row3"])
    trainer.actor.update_weights("meta")
    trainer._evaluate_fn(eval_workflow="w")
    assert trainer.stats_logger.commit(0, 0, 0, {"eval-rollout/cua/success": 1.0}) == "committed"
    assert trainer.actor.calls == [
        ("ppo_update", ["row1", "row2", "row3"]),
        ("update_weights", "meta"),
    ]
    assert trainer.evals == 1 and trainer.stats_logger.commits[0][2] == 0
    assert hooks.current_step == 2
    assert tm.flush(20)
    tm.close()
    db = sqlite3.connect(monitor.db_path)
    assert db.execute(
        "SELECT step, status, num_trajectories FROM step ORDER BY step"
    ).fetchall() == [
        (1, "completed", 3),
        (2, "rollout_running", None),
    ]
    assert db.execute("SELECT step, status FROM eval").fetchall() == [(1, "completed")]
    db.close()
    with pytest.raises(RuntimeError, match="update failed"):
        failing = _FakeTrainer(fail=True)
        TrainerHooks(
            TrainingMonitor(None, RUN), total_steps=1, model_path="m", eval_tasks=0
        ).attach(failing)
        failing.actor.ppo_update("b")


def test_the_training_s_phase_is_its_step_s_again_after_the_baseline_and_an_eval(monitor, tmp_path):
    tm = _tm(monitor.url, tmp_path)
    db = sqlite3.connect(monitor.db_path)

    def phase() -> str:
        assert tm.flush(20)
        return db.execute(
            "SELECT current_phase FROM training WHERE run_name = ?", (RUN,)
        ).fetchone()[0]

    tm.training_started(config=_Config(), total_steps=2)
    trainer = _FakeTrainer()
    TrainerHooks(tm, total_steps=2, model_path="m", eval_tasks=1).attach(trainer)  # opens step 1
    assert phase() == "rollout"
    tm.baseline_started(model_path="m", total_tasks=1)  # as app/train.py's run_baseline, after
    assert phase() == "evaluation"
    tm.baseline_finished({"eval-rollout/cua/success": 0.0})
    assert phase() == "rollout"  # step 1's episodes run on
    trainer.actor.ppo_update(["row"])
    assert phase() == "training"
    trainer._evaluate_fn(eval_workflow="w")
    assert phase() == "evaluation"
    tm.eval_finished(1, {"eval-rollout/cua/success": 1.0}, total_tasks=1)
    assert phase() == "training"
    tm.close()
    db.close()


@pytest.mark.parametrize(
    ("error", "status"),
    [(KeyboardInterrupt("SIGTERM"), "cancelled"), (RuntimeError("oom"), "failed")],
)
def test_a_run_that_dies_closes_its_open_baseline_and_eval(monitor, tmp_path, error, status):
    tm = _tm(monitor.url, tmp_path)
    tm.training_started(config=_Config(), total_steps=2)
    tm.baseline_started(model_path="m", total_tasks=2)
    tm.eval_started(3, model_path="m", total_tasks=2)
    tm.training_failed(error)
    assert tm.flush(20)
    tm.close()
    db = sqlite3.connect(monitor.db_path)
    expected_message = f"{type(error).__name__}: {error}"
    assert db.execute("SELECT status, error_message FROM baseline").fetchall() == [
        (status, expected_message)
    ]
    assert db.execute("SELECT step, status, error_message FROM eval").fetchall() == [
        (3, status, expected_message)
    ]
    db.close()


def test_a_running_training_refreshes_its_heartbeat(monitor, tmp_path):
    cfg = MonitorClientConfig(base_url=monitor.url, spool_path=str(tmp_path / "spool.jsonl"))
    tm = TrainingMonitor(cfg, RUN, heartbeat_s=0.2)
    tm.start()
    tm.training_started(config=_Config(), total_steps=2, log_path="logs")
    assert tm.flush(20)

    def beat():
        db = sqlite3.connect(monitor.db_path)
        try:
            return db.execute("SELECT last_heartbeat FROM training").fetchone()[0]
        finally:
            db.close()

    first = beat()
    # Nothing else is recorded meanwhile: only a heartbeat can move it. Wait for one (bounded)
    # rather than sleeping a fixed time a loaded machine might not fit a beat into.
    deadline = time.monotonic() + 20
    while beat() == first and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tm.flush(20)
    later = beat()
    assert later > first
    tm.training_finished()
    assert tm.flush(20)
    ended = beat()
    time.sleep(0.6)
    assert tm.flush(20)
    assert beat() == ended  # a finished training beats no more
    tm.close()


def test_a_config_changed_after_its_record_is_recorded_again(monitor, tmp_path):
    from dataclasses import dataclass, field

    @dataclass
    class Spec:
        env_vars: dict = field(default_factory=dict)

    @dataclass
    class Config:
        seed: int = 3
        spec: Spec = field(default_factory=Spec)

    config = Config()
    tm = _tm(monitor.url, tmp_path)
    tm.training_started(config=config, total_steps=1, log_path="logs")
    assert tm.config_ran(config) == []  # unchanged: nothing sent again
    config.spec.env_vars["NCCL_CUMEM_ENABLE"] = "0"  # as PPOTrainer amends it for SGLang
    assert tm.config_ran(config) == ["spec.env_vars.NCCL_CUMEM_ENABLE"]
    assert tm.flush()
    tm.close()
    with sqlite3.connect(monitor.db_path) as db:
        (recorded,) = db.execute("SELECT config_json FROM training").fetchone()
    assert json.loads(recorded) == {"seed": 3, "spec": {"env_vars": {"NCCL_CUMEM_ENABLE": "0"}}}
