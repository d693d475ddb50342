"""bench/credit_arms.py on run folders built by hand: monitor databases written through the
monitor's real store, whose rollouts' successes and steps' step-credit statistics are chosen
here, with the expected rates, steps and means worked out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from cua_rl.monitor.server.store import MonitorStore
from tests.bench import load_bench


@pytest.fixture(scope="module")
def bench():
    with load_bench("credit_arms") as module:
        yield module


def _run(folder: Path, successes: list[list[int]], credit: list[dict] | None = None) -> Path:
    """A run folder as ``python -m cua_rl.app.learn`` leaves it: its monitor.db, one step per
    list of rollout outcomes (a failed rollout besides them: not counted), and per step the
    ``rollout/cua/credit/*`` statistics when given."""
    folder.mkdir(parents=True)
    name = folder.name
    steps, rollouts = [], []
    for n, outcomes in enumerate(successes, start=1):
        metrics = {"rollout/cua/success": 0.5}
        if credit:
            metrics |= {f"rollout/cua/credit/{k}": v for k, v in credit[n - 1].items()}
        steps.append({"client_id": f"{name}-s{n}", "training_client_id": name, "step": n,
                      "status": "completed", "metrics_json": metrics})  # fmt: skip
        for i, ok in enumerate([*outcomes, None]):
            rollouts.append({
                "client_id": f"{name}-s{n}-r{i}", "rollout_id": f"{name}-s{n}-r{i}",
                "step_client_id": f"{name}-s{n}", "task_client_id": "t", "model_path": "m",
                "status": "failed" if ok is None else "completed",
                "reward": None if ok is None else float(ok), "task_success": ok or 0,
            })  # fmt: skip
    store = MonitorStore(folder / "monitor.db")
    try:
        store.ingest({
            "training": {"client_id": name, "run_name": name, "log_path": "l", "model_name": "m"},
            "tasks": [{"client_id": "t", "task_id": "t", "name": "t", "description": "d"}],
            "steps": steps,
            "rollouts": rollouts,
        })  # fmt: skip
    finally:
        store.close()
    return folder


STATS = {"grouped_share": 1.0, "step_group_size": 16.0, "step_group_size_max": 30.0,
         "false_merges": 0.0, "unknown_episodes": 0.0, "step_advantage_abs": 0.3}  # fmt: skip


def test_success_per_step_steps_to_target_and_the_step_groups(bench, tmp_path, capsys):
    # Rates 0.25, 0.75, 1.0, 1.0: the mean of 2 steps first reaches 0.8 at step 3 (0.875).
    a = _run(tmp_path / "step-a", [[1, 0, 0, 0], [1, 1, 1, 0], [1] * 4, [1] * 4],
             credit=[STATS, {**STATS, "step_advantage_abs": 0.1}, STATS | {"false_merges": 1.0},
                     {"errors": 0.0}])  # fmt: skip
    # Rates 0.5, 1.0, 0.5, 1.0: the windows are 0.75, 0.75, 0.75: never.
    b = _run(tmp_path / "episode-a", [[1, 0], [1, 1], [0, 1], [1, 1]])
    png = tmp_path / "arms.png"
    args = ["--arm", "step", str(a), "--arm", "episode", str(b), "--window", "2"]
    assert bench.main([*args, "--out", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == "step step-a reached 3 0.25 0.75 1.00 1.00".split()
    # Averaged over the three steps that exported them; the fourth exported only errors.
    assert (
        out[1].split()
        == (
            "grouped 1.00, step group size 16.0 (largest 30.0), false merges 0.33/group, unknown "
            "episodes 0.00/group, |step advantage| 0.233"
        ).split()
    )
    assert out[2].split() == "episode episode-a reached never 0.50 1.00 0.50 1.00".split()
    assert out[4].split() == "step reached at 3 median 3".split()
    assert out[5].split() == "episode reached at never median never".split()
    assert out[6] == f"plot: {png}"
    with Image.open(png) as image:
        assert image.width > 2 * image.height  # two panels side by side


def test_a_run_that_never_reaches_is_later_than_any_that_did(bench, tmp_path, capsys):
    solved = [[1, 1]] * 2
    runs = [_run(tmp_path / "a", solved), _run(tmp_path / "b", [[0, 0]] * 2)]
    runs.append(_run(tmp_path / "c", [[0, 0], [1, 1]]))
    assert bench.main(["--arm", "x", *map(str, runs), "--window", "1"]) == 0
    # Reached at 1, never, 2: sorted 1, 2, never; the median is the middle one.
    assert (
        capsys.readouterr().out.splitlines()[-1].split()
        == "x reached at 1,never,2 median 2".split()
    )
