"""How many steps a run trains, and that a run stopping before ``total_train_steps`` says why:
AReaL trains min(total_train_epochs x batches per epoch, total_train_steps), so a count above the
epochs' is silently cut (the demo with ``total_train_steps=6`` trained 2 steps and said nothing)."""

from __future__ import annotations

from pathlib import Path

from cua_rl.app.config import CUAConfig
from cua_rl.app.config_load import load_config
from cua_rl.app.demo import trainer_reports
from cua_rl.app.train import steps_capped, total_steps

ROOT = Path(__file__).resolve().parents[2]


def _local(tmp_path: Path, *overrides: str) -> CUAConfig:
    argv = ["--config", str(ROOT / "configs/local.yaml"), f"cluster.fileroot={tmp_path}"]
    argv.append(f"actor.path={tmp_path}")
    return load_config([*argv, *overrides], CUAConfig)


def test_steps_above_the_epochs_are_cut_and_said(tmp_path):
    # 8 tasks in batches of 4: 2 batches an epoch; 3 epochs hold 6 steps.
    config = _local(
        tmp_path, "train_dataset.batch_size=4", "total_train_epochs=3", "total_train_steps=10"
    )
    assert total_steps(config, 8) == 6
    line = steps_capped(config, 8)
    assert line is not None and line.startswith("note: ")
    for said in ("total_train_steps=10", "total_train_epochs=3", "2 batches", "training 6 steps"):
        assert said in line, (said, line)


def test_no_note_when_the_steps_asked_fit(tmp_path):
    # configs/local.yaml itself asks for 2 steps; null: the epochs' count.
    fits = _local(
        tmp_path, "train_dataset.batch_size=4", "total_train_epochs=3", "total_train_steps=null"
    )
    for steps in ("6", "2", "null"):
        config = _local(
            tmp_path, "train_dataset.batch_size=4", "total_train_epochs=3",
            f"total_train_steps={steps}",
        )  # fmt: skip
        assert steps_capped(config, 8) is None, steps
    assert total_steps(fits, 8) == 6
    assert (
        total_steps(_local(tmp_path, "train_dataset.batch_size=4", "total_train_steps=2"), 8) == 2
    )


def test_the_demo_repeats_the_trainers_notes_and_drain_reports_at_the_end(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        "(AReaL) INFO: up\n"
        "note: total_train_steps=6, but ... training 2 steps (raise total_train_epochs to train 6)\n"
        "20261128 cua_rl.rollout.drain: 4 episodes in flight closed\n"
        "a line mentioning note: in the middle\n"
    )
    assert trainer_reports(log) == [
        "note: total_train_steps=6, but ... training 2 steps (raise total_train_epochs to train 6)",
        "drain: 4 episodes in flight closed",
    ]
    assert trainer_reports(tmp_path / "absent.log") == []
