"""How the example wires the curriculum in: the config section, the group filter it picks, the
loader the trainer builds, and the step stats and resumed steps the monitor records."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest
from areal.api.cli_args import load_expr_config
from torchdata.stateful_dataloader import StatefulDataLoader

from cua_rl.app.config import CUAConfig
from cua_rl.areal.curriculum_trainer import CurriculumPPOTrainer, make_sampler
from cua_rl.areal.hooks import TrainerHooks
from cua_rl.curriculum.sampler import CurriculumSampler
from cua_rl.curriculum.selector import CurriculumConfig
from cua_rl.errors import ConfigError
from cua_rl.monitor.worker.client import MonitorClientConfig
from cua_rl.monitor.worker.training import TrainingMonitor

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "configs" / "local.yaml"


def _load(tmp_path: Path, *overrides: str) -> CUAConfig:
    argv = ["--config", str(LOCAL), f"cluster.fileroot={tmp_path}", *overrides]
    return load_expr_config(argv, CUAConfig)[0]


def test_the_curriculum_section_loads_and_picks_the_group_filter(tmp_path):
    cfg = _load(tmp_path)
    assert cfg.curriculum.kind == "uniform"
    assert cfg.group_filter() == "cua_rl.rollout.groups.complete_groups"
    cfg = _load(
        tmp_path,
        "curriculum.kind=ucb",
        "+curriculum.floor=0.2",
        "curriculum.drop_zero_variance=true",
        "+curriculum.seed=9",
    )
    assert (cfg.curriculum.kind, cfg.curriculum.floor, cfg.curriculum.seed) == ("ucb", 0.2, 9)
    assert cfg.group_filter() == "cua_rl.rollout.groups.complete_varied_groups"


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        (["curriculum.kind=ucb", "monitor.enabled=false"], "monitor.enabled=true"),
        (["curriculum.kind=ucb", "+train_dataset.num_workers=2"], "num_workers=0"),
        (["curriculum.kind=best"], "uniform, ucb"),
        (["+curriculum.decay=1.5"], "decay"),
    ],
)
def test_bad_curriculum_settings_name_their_fix(tmp_path, overrides, fix):
    with pytest.raises(ConfigError, match=fix):
        _load(tmp_path, *overrides)


def test_make_sampler_needs_a_monitor(tmp_path):
    args = {
        "run_name": "r",
        "monitor_token": None,
        "batch_size": 1,
        "group_size": 2,
        "seed": 0,
        "drop_last": True,
        "log_dir": tmp_path,
    }
    with pytest.raises(ConfigError, match="Training Monitor"):
        make_sampler(CurriculumConfig(kind="ucb"), ["a", "b"], monitor_url="", **args)
    sampler = make_sampler(
        CurriculumConfig(kind="ucb", seed=4), ["a", "b"], monitor_url="http://127.0.0.1:1", **args
    )
    assert sampler.seed == 4 and sampler.log_path == tmp_path / "curriculum.jsonl"
    sampler.close()


def test_the_trainer_puts_the_sampler_in_the_train_loader_only(tmp_path):
    # The one method the override changes, on an instance PPOTrainer.__init__ never ran on.
    train_cfg = SimpleNamespace(batch_size=2, drop_last=True, num_workers=0, shuffle=True)
    valid_cfg = SimpleNamespace(batch_size=1, drop_last=False, num_workers=0, shuffle=False)
    trainer = CurriculumPPOTrainer.__new__(CurriculumPPOTrainer)
    trainer.config = SimpleNamespace(train_dataset=train_cfg, valid_dataset=valid_cfg)
    rows = [{"task_id": t} for t in "abcd"]
    sampler = CurriculumSampler(
        "abcd",
        config=CurriculumConfig(kind="ucb"),
        source=_NoOutcomes(),
        batch_size=2,
        group_size=2,
        seed=1,
    )
    trainer.curriculum_sampler = sampler
    loader = trainer._create_dataloader(rows, train_cfg, rank=0, world_size=1)
    assert isinstance(loader, StatefulDataLoader) and loader.sampler is sampler
    assert len(loader) == 2 and len(next(iter(loader))) == 2
    with pytest.raises(ConfigError, match="single-controller"):
        trainer._create_dataloader(rows, train_cfg, rank=0, world_size=2)
    with pytest.raises(ConfigError, match="4 train tasks"):
        trainer._create_dataloader(rows[:3], train_cfg, rank=0, world_size=1)


class _NoOutcomes:
    def fetch(self):
        return []


class _Logger:
    def __init__(self):
        self.commits = []

    def commit(self, epoch, step, global_step, data):
        self.commits.append(data)


def _trainer(recovered_global_step: int | None = None):
    recover_info = None
    if recovered_global_step is not None:
        recover_info = SimpleNamespace(
            last_step_info=SimpleNamespace(global_step=recovered_global_step)
        )
    # The members TrainerHooks wraps (cua_rl.areal.support declares them on AReaL's trainer).
    actor = SimpleNamespace(ppo_update=lambda batch: None, update_weights=lambda meta: None)
    return SimpleNamespace(
        stats_logger=_Logger(),
        actor=actor,
        recover_info=recover_info,
        _evaluate_fn=lambda **kw: None,
    )


def test_step_stats_reach_the_logger_and_the_monitor_and_resumed_runs_go_on(tmp_path):
    from cua_rl.monitor.server.app import create_app
    from cua_rl.monitor.server.store import MonitorStore
    from cua_rl.serving import ThreadedServer

    store = MonitorStore(str(tmp_path / "m.db"))
    with ThreadedServer(create_app(store)) as server:
        tm = TrainingMonitor(
            MonitorClientConfig(base_url=server.url, spool_path=str(tmp_path / "s")), "run"
        )
        tm.start()
        tm.training_started(config=SimpleNamespace(), total_steps=4)
        calls = iter([{"curriculum/never_tried": 3.0}, RuntimeError("stats bug")])

        def step_stats():
            item = next(calls)
            if isinstance(item, Exception):
                raise item
            return item

        # A run AReaL recovered after global step 1 (steps 1 and 2 done) goes on with step 3.
        trainer = _trainer(recovered_global_step=1)
        hooks = TrainerHooks(tm, total_steps=4, model_path="m", eval_tasks=0, step_stats=step_stats)
        hooks.attach(trainer)
        assert hooks.current_step == 3
        trainer.stats_logger.commit(0, 0, 2, {"rollout/cua/reward": 0.5})
        # A failing stats source never stops the commit.
        trainer.stats_logger.commit(0, 1, 3, {"rollout/cua/reward": 0.25})
        assert tm.flush(20)
        tm.close()
    assert trainer.stats_logger.commits == [
        {"rollout/cua/reward": 0.5, "curriculum/never_tried": 3.0},
        {"rollout/cua/reward": 0.25},
    ]
    db = sqlite3.connect(tmp_path / "m.db")
    rows = db.execute("SELECT step, status, metrics_json FROM step ORDER BY step").fetchall()
    db.close()
    store.close()
    assert [(s, st) for s, st, _ in rows] == [(3, "completed"), (4, "completed")]
    assert json.loads(rows[0][2])["curriculum/never_tried"] == 3.0
