"""bench/learn_arms.py on run folders built by hand: monitor databases written through the
monitor's real store, with step shares whose pooled figures are worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from cua_rl.monitor.server.store import MonitorStore
from tests.bench import load_bench

GROUP = 12  # episodes per group; every step below trains 2 groups (24 episodes)


@pytest.fixture(scope="module")
def bench():
    with load_bench("learn_arms") as module:
        yield module


def _run(folder: Path, steps: list[dict], wall_s: float | None = None) -> Path:
    """A run folder as ``python -m cua_rl.app.learn`` leaves it: monitor.db (and curve.json)."""
    folder.mkdir(parents=True)
    store = MonitorStore(folder / "monitor.db")
    try:
        store.ingest(
            {
                "training": {"run_name": folder.name, "log_path": "runs/x", "model_name": "tiny"},
                "steps": [
                    {
                        "client_id": f"{folder.name}-step-{n}",
                        "training_client_id": folder.name,
                        "step": n,
                        "status": "completed",
                        "num_trajectories": 2 * GROUP,
                        "metrics_json": {f"rollout/cua/{k}": v for k, v in metrics.items()},
                    }
                    for n, metrics in enumerate(steps, start=1)
                ],
            }
        )
    finally:
        store.close()
    if wall_s is not None:
        (folder / "curve.json").write_text(json.dumps({"wall_s": wall_s}))
    return folder


def _fail(rescued: float) -> dict:
    """A step of two all-fail groups, ``rescued`` of them given a replayed success."""
    return {"success": 0.0, "group/zero_variance": 1 - rescued, "replay/all_fail": 1.0,
            "replay/rescued": rescued}  # fmt: skip


SOLVED = {"success": 1.0, "group/zero_variance": 1.0, "replay/all_fail": 0.0}
# One group with successes, one all-fail group that got a replayed success.
MIXED = {"success": 0.25, "group/zero_variance": 0.0, "replay/all_fail": 0.5, "replay/rescued": 1.0}


def test_the_table_and_plot_of_two_arms(bench, tmp_path, capsys):
    # Replay: both seeds reach 0.8 (window 1) at step 3; a's first success is there, b's at 2.
    a = _run(tmp_path / "on-a", [_fail(0.0), _fail(0.5), SOLVED], wall_s=400.4)
    b = _run(tmp_path / "on-b", [_fail(1.0), MIXED, SOLVED])
    # No replay: never; the filter records no replay statistic.
    c = _run(tmp_path / "off-a", [{"success": 0.0, "group/zero_variance": 1.0}] * 3)
    png = tmp_path / "arms.png"
    args = ["--arm", "replay", str(a), str(b), "--arm", "none", str(c)]
    assert bench.main([*args, "--window", "1", "--group-size", str(GROUP), "--out", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    runs = {line.split()[1]: line.split() for line in out[1:4]}
    # on-a: zero variance before step 3: 2 + 1 of 4 groups; 4 of 6 groups all-fail, 1 rescued;
    # from its first success (step 3) on, no all-fail group.
    assert runs["on-a"] == "replay on-a 3 3 1.00 0.75 0.67 1 of 4 (0.25) 0 of 0 (-) 400s".split()
    # on-b: before step 3: 0 of 4; all-fail 2 + 1 of 6 groups, all 3 rescued; from step 2 on, 1
    # of 4 groups all-fail, rescued; no curve.json: no wall.
    assert runs["on-b"] == "replay on-b 2 3 1.00 0.00 0.50 3 of 3 (1.00) 1 of 1 (1.00) -".split()
    assert runs["off-a"] == "none off-a never never 0.00 1.00 - - - -".split()
    arms = {line.split()[0]: line.split() for line in out[6:8]}
    # Pooled: zero variance 3 of 8 groups before the targets; 7 of 12 groups all-fail, 4 of
    # those rescued; from the first successes on, 1 of 1.
    assert arms["replay"] == "replay 2 3,3 3 0.38 0.58 4 of 7 (0.57) 1 of 1 (1.00)".split()
    assert arms["none"] == "none 1 never never 1.00 - - -".split()
    with Image.open(png) as img:
        assert img.size == (990, 440)


def test_an_arm_needs_distinct_run_folders(bench, tmp_path):
    a = _run(tmp_path / "a", [SOLVED])
    with pytest.raises(SystemExit):
        bench.main(["--arm", "replay", str(a), str(a)])
    with pytest.raises(SystemExit):
        bench.main(["--arm", "replay"])
