"""Proof of learning: the curve tools, the negative control's mask, and (slow) real training.

The fast tests read curves from real monitor databases written through ``MonitorStore``. The
slow test trains the tiny Qwen2-VL on the learn family with ``make learn``'s launcher
twice: the production workflow must raise its success rate by a margin, and the control that
credits each episode with the next episode's reward must not, in the same budget (it cannot by
construction: cua_rl/app/controls.py). The margin and the runs behind it are in
docs/learning.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from cua_rl.app.controls import shift_mask_right
from cua_rl.app.learn import Progress, StopAt, format_arm
from cua_rl.app.learning_curves import (
    CurveError,
    GroupShares,
    StepPoint,
    first_last,
    format_curve,
    from_first_success,
    group_shares,
    median_step,
    plot_arms,
    plot_curves,
    read_curve,
    steps_to_reach,
    successes,
    summarise_arm,
)
from cua_rl.monitor.server.store import MonitorStore
from tests.conftest import note_cost

ROOT = Path(__file__).resolve().parents[2]


def _write_run(db: Path, run: str, steps: list[tuple[int, str, float | None]], start: str):
    """A training ``run`` with steps (number, status, success) ending a minute apart."""
    store = MonitorStore(db)
    try:
        store.ingest(
            {
                "training": {
                    "run_name": run,
                    "log_path": "runs/x",
                    "model_name": "tiny",
                    "start_time": start,
                },
                "steps": [
                    {
                        "client_id": f"{run}-step-{n}",
                        "training_client_id": run,
                        "step": n,
                        "status": status,
                        "num_trajectories": 24,
                        "end_time": f"2026-01-01 00:{n:02d}:30",
                        "metrics_json": {} if success is None else {"rollout/cua/success": success},
                    }
                    for n, status, success in steps
                ],
            }
        )
    finally:
        store.close()


def _points(values: list[float]) -> list[StepPoint]:
    return [StepPoint(i + 1, v, v, 24, None, None) for i, v in enumerate(values)]


def test_read_curve_gives_the_latest_trainings_committed_steps_in_order(tmp_path):
    db = tmp_path / "monitor.db"
    _write_run(db, "old", [(1, "completed", 0.9)], "2026-01-01 00:00:00")
    _write_run(
        db,
        "new",
        [(2, "completed", 0.5), (1, "completed", 0.25), (3, "training", None)],
        "2026-01-01 00:00:00",
    )
    points = read_curve(db)
    assert [(p.step, p.success, p.episodes) for p in points] == [(1, 0.25, 24), (2, 0.5, 24)]
    assert [p.elapsed_s for p in points] == [90.0, 150.0]
    assert [p.success for p in read_curve(db, "old")] == [0.9]


def test_a_step_without_the_statistic_is_read_as_unknown(tmp_path):
    db = tmp_path / "monitor.db"
    _write_run(db, "r", [(1, "completed", None), (2, "completed", 1.0)], "2026-01-01 00:00:00")
    points = read_curve(db)
    assert points[0].success is None
    assert steps_to_reach(points, 0.5, window=1) == 2
    assert steps_to_reach(points, 0.5, window=2) is None  # one measured step only


def test_read_curve_errors_say_what_is_missing(tmp_path):
    with pytest.raises(CurveError, match="no monitor database"):
        read_curve(tmp_path / "absent.db")
    db = tmp_path / "monitor.db"
    MonitorStore(db).close()
    with pytest.raises(CurveError, match="no record of any training"):
        read_curve(db)
    _write_run(db, "r", [], "2026-01-01 00:00:00")
    with pytest.raises(CurveError, match="no record of training 'other'"):
        read_curve(db, "other")
    assert read_curve(db) == []


def test_steps_to_reach_uses_the_trailing_window():
    points = _points([0.1, 0.0, 0.2, 0.9, 0.9, 0.8])
    assert steps_to_reach(points, 0.8, window=1) == 4
    assert steps_to_reach(points, 0.8, window=3) == 6  # (0.9 + 0.9 + 0.8) / 3
    assert steps_to_reach(points, 0.95, window=1) is None
    with pytest.raises(CurveError):
        steps_to_reach(points, 0.8, window=0)


def test_first_last_needs_two_disjoint_windows():
    assert first_last(_points([0.0, 0.5, 1.0, 1.0]), 2) == (0.25, 1.0)
    with pytest.raises(CurveError, match="disjoint"):
        first_last(_points([0.0, 0.5, 1.0]), 2)


def test_steps_without_a_success_rate_are_skipped_not_counted_as_zero():
    # An asynchronous step whose batch was exported with the previous step stores no rate.
    points = _points([0.0, None, 1.0, None, 1.0, 1.0])
    assert successes(points) == [0.0, 1.0, 1.0, 1.0]
    assert first_last(points, 2) == (0.5, 1.0)
    assert steps_to_reach(points, 1.0, window=2) == 5  # steps 3 and 5, step 4 unknown
    with pytest.raises(CurveError, match="measured"):
        first_last(_points([1.0, None, None, 1.0]), 2)


def test_plot_and_table(tmp_path):
    a, b = _points([0.1, 0.6, 1.0]), _points([0.0, 0.1])
    png = plot_curves({"a": a, "b": b}, tmp_path / "sub" / "success.png", target=0.8)
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size == (770, 440)
    lines = format_curve(a)
    assert lines[1].startswith("step   2  success 0.600") and lines[1].endswith("#" * 12)
    with pytest.raises(CurveError):
        plot_curves({"a": []}, tmp_path / "empty.png")


def _step(n, success, episodes=24, zero=None, fail=None, rescued=None) -> StepPoint:
    return StepPoint(n, success, success, episodes, None, None, zero, fail, rescued)


# Hand-worked groups of 12 episodes: step 1 has 2 groups, both all-fail, 1 rescued (so 1 keeps
# zero variance); step 2 has 4 groups (48 episodes), 2 all-fail both rescued, 1 all-success; step
# 3 has 2 all-success groups; step 4 exported no group statistic.
REPLAYED = [
    _step(1, 0.0, 24, zero=0.5, fail=1.0, rescued=0.5),
    _step(2, 0.25, 48, zero=0.25, fail=0.5, rescued=1.0),
    _step(3, 1.0, 24, zero=1.0, fail=0.0),
    _step(4, 1.0, 24),
]


def test_group_shares_are_the_shares_of_all_groups_not_the_mean_of_step_shares():
    shares = group_shares(REPLAYED)
    # 4 of 8 groups without variance, 4 of 8 all-fail, 3 of those 4 rescued.
    assert shares == GroupShares(zero_variance=0.5, all_fail=0.5, rescued=0.75, episodes=96)
    # The plain mean of the steps' shares would say 0.58 and 0.5 (below), not 0.5 and 0.75.
    assert sum(p.zero_variance for p in REPLAYED[:3]) / 3 == pytest.approx(0.583, abs=1e-3)
    without_replay = [_step(1, 0.0, zero=1.0), _step(2, 0.1, 48, zero=0.5)]
    assert group_shares(without_replay) == GroupShares(2 / 3, None, None, 72)
    assert group_shares([_step(1, 0.0)]) == GroupShares(None, None, None, 0)


def test_from_first_success_drops_the_steps_before_it():
    assert [p.step for p in from_first_success(REPLAYED)] == [2, 3, 4]
    assert from_first_success([_step(1, 0.0), _step(2, None)]) == []


def test_median_step_ranks_a_run_that_never_reached_after_every_run_that_did():
    assert median_step([20, 13, None]) == 20
    assert median_step([13, None, None]) is None
    assert median_step([10, 20]) == 15
    assert median_step([10, None]) is None
    assert median_step([28]) == 28
    with pytest.raises(CurveError, match="no runs"):
        median_step([])


def test_an_arm_pools_zero_variance_before_each_runs_target_and_rescues_over_whole_runs():
    # Reaches 0.8 (window 1) at step 3: its zero-variance share counts steps 1 and 2 only.
    fast = REPLAYED
    # Never reaches it: every step counts.
    slow = [_step(1, 0.0, zero=1.0, fail=1.0, rescued=0.0), _step(2, 0.0, zero=1.0, fail=1.0)]
    arm = summarise_arm([fast, slow], target=0.8, window=1)
    assert arm.runs == 2 and arm.reached == [3, None] and arm.median_reached is None
    # Before the target: (1 + 1) of fast's 6 groups, 4 of slow's 4.
    assert arm.before_target.zero_variance == pytest.approx(6 / 10)
    # Whole runs: 4 of fast's 8 groups and slow's 4 all-fail; 3 of those 8 rescued.
    assert arm.whole.all_fail == pytest.approx(8 / 12)
    assert arm.whole.rescued == pytest.approx(3 / 8)
    assert summarise_arm([fast, fast, slow], 0.8, 1).median_reached == 3
    with pytest.raises(CurveError):
        summarise_arm([], 0.8)
    line = format_arm("learn-hard-replay-on", arm, 0.8)
    assert line == (
        "[learn] learn-hard-replay-on: 2 runs, target 0.8 reached at 3, never: median never; "
        "zero-variance groups before the target 0.60; all-fail groups 0.67 of all, "
        "rescued by replay 0.38 of them"
    )


def test_plot_arms_draws_a_panel_per_arm(tmp_path):
    arms = {"off": {"s1": _points([0.0, 0.5])}, "on": {"s1": _points([0.5, 1.0]), "s2": []}}
    png = plot_arms(arms, tmp_path / "arms.png", target=0.8)
    with Image.open(png) as img:
        assert img.size == (990, 440)  # 2 panels of 4.5 x 4 inches at 110 dpi
    with pytest.raises(CurveError, match="every arm"):
        plot_arms({"off": {"s1": []}, "on": arms["on"]}, tmp_path / "none.png")


def test_progress_prints_each_committed_step_once(tmp_path, capsys):
    db = tmp_path / "monitor.db"
    progress = Progress(db, "run", total=5)
    progress.poll()  # no database yet: nothing, no error
    _write_run(db, "r", [(1, "completed", 0.125)], "2026-01-01 00:00:00")
    progress.poll()
    progress.start()  # the thread's own polls and the final one print nothing new
    progress.halt()
    assert not progress.is_alive()
    out = capsys.readouterr().out.splitlines()
    assert out == ["[learn] run step 1/5: success 0.125 (3/24) at 90s"]


def test_progress_asks_the_run_to_stop_once_the_target_is_reached(tmp_path, capsys):
    db = tmp_path / "monitor.db"
    progress = Progress(db, "run", total=20, stop_at=StopAt(target=0.8, window=3))
    _write_run(db, "r", [(1, "completed", 0.1), (2, "completed", 0.9)], "2026-01-01 00:00:00")
    progress.poll()
    assert not progress.stop.is_set()  # 2 steps: no window of 3 yet
    # Steps 2-4 average 0.9: reached at step 4 (a step 5 committed meanwhile changes nothing).
    _write_run(db, "r", [(3, "completed", 0.8), (4, "completed", 1.0)], "2026-01-01 00:00:00")
    progress.poll()
    assert progress.stop.is_set() and progress.stopped_at == 4
    _write_run(db, "r", [(5, "completed", 1.0)], "2026-01-01 00:00:00")
    progress.poll()
    assert progress.stopped_at == 4
    out = capsys.readouterr().out.splitlines()
    assert (
        out[-2] == "[learn] run: target 0.8 reached at step 4: stopping the run (--stop-at-target)"
    )
    # Without the option the run goes on whatever it reaches.
    plain = Progress(db, "run", total=20)
    plain.poll()
    assert not plain.stop.is_set() and plain.stopped_at is None


def test_the_control_mask_skips_the_first_generated_token():
    mask = torch.tensor([[0, 0, 0, 1, 1, 1]], dtype=torch.int32)
    shifted = shift_mask_right(mask)
    assert shifted.tolist() == [[0, 0, 0, 0, 1, 1]]
    assert shifted.dtype == mask.dtype and mask.tolist() == [[0, 0, 0, 1, 1, 1]]


# -- real training ------------------------------------------------------------------------------

# `make learn`'s whole length: the step at which a run crosses 0.5 success varies from 7 to past
# 12 between reruns of one seed (vLLM sampling and the asynchronous batching are not
# deterministic); every measured run held >= 0.9 from step 17 on (docs/learning.md).
STEPS = 20
WINDOW = 3
# Measured (docs/learning.md): the real workflow's runs gained >= 0.85 between their first and
# last 3 steps of 20; the shifted-credit controls gained <= 0. 0.4 sits between, with room on
# both sides. (The shifted-mask control is not required flat: it gained up to 0.97 in some runs.)
MARGIN = 0.4
# `make learn`'s target: where the learning run may stop early.
TARGET = 0.8


def _learn(
    tmp_path: Path, name: str, *extra: str, steps: int = STEPS, env: dict[str, str] | None = None
) -> dict:
    run_dir = tmp_path / name
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cua_rl.app.learn",
            "--run-dir",
            str(run_dir),
            "--steps",
            str(steps),
            "--window",
            str(WINDOW),
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    note_cost(f"learning proof {name}", time.monotonic() - t0)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    curve = json.loads((run_dir / "curve.json").read_text())
    stopped = curve["stopped_at_target"]
    # All its steps, or (--stop-at-target) up to the step that reached the target, or the one
    # committed while the run stopped.
    assert curve["steps"] == steps if stopped is None else stopped <= curve["steps"] <= steps, curve
    assert (run_dir / "success.png").is_file()
    return curve


@pytest.mark.slow
@pytest.mark.timeout(1900)
def test_the_policy_learns_and_the_shifted_credit_control_does_not(
    tmp_path, tiny_vl_bpe_model_dir, model_servers, warm_env
):
    # Both runs borrow the session's server; each loads the tiny model's initial weights into it.
    borrow = model_servers("qwen2-vl-bpe").borrow_override()
    # The learning run ends once 3 steps average 0.8 success (at steps 10-12 in the measured
    # runs at this staleness): its last 3 steps are then that window, a gain of 0.7 or more.
    learned = _learn(
        tmp_path, "learn", "--stop-at-target", "--target", str(TARGET), borrow, env=warm_env
    )
    gain = learned["last_mean"] - learned["first_mean"]
    assert gain >= MARGIN, learned["success"]

    # The control gets the learning run's budget: as many steps as it needed (all 20 where it
    # never reached the target). Over 20 steps the measured controls gained <= 0.
    control = _learn(
        tmp_path, "control", "--control", "shifted-credit", borrow, steps=learned["steps"],
        env=warm_env,
    )  # fmt: skip
    gain = control["last_mean"] - control["first_mean"]
    assert gain < MARGIN, control["success"]


def test_family_and_context_flags_reach_the_training_config(tmp_path):
    from areal.api.cli_args import parse_cli_args, to_structured_cfg
    from omegaconf import OmegaConf

    from cua_rl.app.config import CUAConfig
    from cua_rl.app.learn import agent_overrides, parse_args

    args = parse_args(["--family", "learn2", "--context", "mai-ui", "--history-n", "2"])
    assert args.config == "configs/learn2.yaml"
    assert parse_args(["--context", "current"]).config == "configs/learn.yaml"
    assert parse_args(["--family", "learn2", "--config", "x.yaml"]).config == "x.yaml"
    # Copies in one folder, so the defaults lists find learn.yaml and local.yaml.
    root = Path(__file__).resolve().parents[2] / "configs"
    for name in ("local.yaml", "learn.yaml", "learn2.yaml"):
        (tmp_path / name).write_text((root / name).read_text())
    raw, _ = parse_cli_args(["--config", str(tmp_path / args.config.split("/")[-1]),
                             *agent_overrides(args)])  # fmt: skip
    cfg = OmegaConf.to_object(to_structured_cfg(raw, config_cls=CUAConfig))
    assert cfg.gym.selection.tags == ["learn2"]
    assert cfg.agent.max_steps == 2
    assert (cfg.agent.context, cfg.agent.history_n) == ("mai-ui", 2)
    assert cfg.agent.run_model_options() == {"context": "mai-ui", "historyN": 2}
    assert cfg.gconfig.n_samples * cfg.train_dataset.batch_size == 24


def test_the_learn_hard_family_reads_replies_on_a_10x10_grid(tmp_path):
    from areal.api.cli_args import parse_cli_args, to_structured_cfg
    from omegaconf import OmegaConf

    from cua_rl.app.config import CUAConfig
    from cua_rl.app.learn import REPLAY_ARMS, parse_args
    from cua_rl.errors import ConfigError

    args = parse_args(["--family", "learn-hard"])
    assert args.config == "configs/learn-hard.yaml"
    root = Path(__file__).resolve().parents[2] / "configs"
    for name in ("local.yaml", "learn.yaml", "learn-hard.yaml"):
        (tmp_path / name).write_text((root / name).read_text())

    def load(*overrides: str) -> CUAConfig:
        raw, _ = parse_cli_args(["--config", str(tmp_path / "learn-hard.yaml"), *overrides])
        return OmegaConf.to_object(to_structured_cfg(raw, config_cls=CUAConfig))

    cfg = load()
    assert cfg.replay.enabled is False  # off unless asked
    on = load(*REPLAY_ARMS["on"])
    assert on.replay.enabled and not on.replay.shuffle_rewards
    assert on.workflow_settings().group.replay.enabled
    control = load(*REPLAY_ARMS["shuffled"])
    assert control.replay.enabled and control.replay.shuffle_rewards
    with pytest.raises(ConfigError, match="must be below gconfig.n_samples=12"):
        load(*REPLAY_ARMS["on"], "replay.per_group=12", "replay.pool_per_task=12")
    with pytest.raises(ConfigError, match="read from the Training Monitor"):
        load(*REPLAY_ARMS["on"], "replay.trainings=[other]", "monitor.enabled=false")
    assert cfg.gym.selection.tags == ["learn-hard"]
    assert cfg.agent.max_steps == 1
    assert cfg.agent.model_options["parse"] == "lenient"
    assert cfg.agent.model_options["lenientGrid"] == 10
    assert cfg.gconfig.n_samples * cfg.train_dataset.batch_size == 24
