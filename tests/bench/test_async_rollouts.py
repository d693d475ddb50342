"""The arithmetic of bench/async_rollouts.py on a hand-built monitor database.

The database has the monitor's real schema (``MonitorStore`` migrates it); rows are written with
plain SQL at hand-picked times, so every expected figure below is worked out by hand.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from pathlib import Path

import pytest

from tests.bench import load_bench, training_db

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    with load_bench("async_rollouts") as module:
        yield module


def test_union_of_step_intervals(bench):
    # (0,2) and (1,3) overlap into (0,3); clipped to [0.5, 5.5] with (5,6): 2.5 + 0.5.
    assert bench.union_seconds([(5, 6), (0, 2), (1, 3)], 0.5, 5.5) == pytest.approx(3.0)
    assert bench.union_seconds([(7, 9)], 0, 5) == 0.0
    assert bench.union_seconds([], 0, 5) == 0.0


def _at(seconds: int) -> str:
    return f"2024-05-01 10:{seconds // 60:02d}:{seconds % 60:02d}.000000"


def _run_db(path: Path) -> None:
    db = training_db(path, "completed")
    db.execute("INSERT INTO baseline (id, training_id, model_path) VALUES (1, 1, 'm')")
    metrics = {
        "ppo_actor/n_seqs": 4,
        "timeperf/rollout": 10.0,
        "timeperf/train_step": 3.0,
        "timeperf/update_weights": 2.0,
        "rollout/cua/accepted": 0.75,
        "rollout/cua/rejected/gateway_error": 0.25,
    }
    for step, start, end in ((1, 0, 30), (2, 30, 60)):
        db.execute(
            "INSERT INTO step (id, training_id, step, status, start_time, end_time, metrics_json) "
            "VALUES (?, 1, ?, 'completed', ?, ?, ?)",
            (step, step, _at(start), _at(end), json.dumps(metrics)),
        )
    rollouts = [
        # id, source, status, error, end, box created, box terminated, turns; each rollout
        # starts as its box is created. The baseline (0..20) runs before the first training one.
        (1, "step", "completed", None, 30, 5, 31, [(7, 10), (9, 15)]),
        (2, "step", "failed", "gateway_error", 20, 10, 20, []),
        (3, "step", "cancelled", "cancelled", 70, 50, 70, [(55, 65)]),
        (4, "baseline", "completed", None, 20, 0, 20, [(1, 19)]),
    ]
    for rid, source, status, error, end, born, died, turns in rollouts:
        ref = "step_id" if source == "step" else "baseline_id"
        db.execute(
            f"INSERT INTO rollout (id, source_type, {ref}, rollout_id, task_id, model_path, "
            "status, error_message, start_time, end_time) VALUES (?, ?, 1, ?, 1, 'm', ?, ?, ?, ?)",
            (rid, source, f"u{rid}", status, error, _at(born), _at(end)),
        )
        db.execute(
            "INSERT INTO environment (rollout_id, env_type, status, creation_time, "
            "termination_time) VALUES (?, 'android', 'terminated', ?, ?)",
            (rid, _at(born), _at(died)),
        )
        for n, (a, b) in enumerate(turns, 1):
            db.execute(
                "INSERT INTO turn (rollout_id, turn, start_time, end_time) VALUES (?, ?, ?, ?)",
                (rid, n, _at(a), _at(b)),
            )
    db.commit()
    db.close()


def test_figures_of_a_recorded_run(bench, tmp_path):
    _run_db(tmp_path / "monitor.db")
    log = tmp_path / "areal" / "logs" / "u" / "exp" / "trial" / "rollout.log"
    log.parent.mkdir(parents=True)
    log.write_text(
        "noise\n... WARNING cua_rl.rollout.groups: group rejected: 1 of 2 episodes returned rows\n"
    )

    fig = bench.read_run(bench.RunFigures(1, tmp_path, 0, 0.0), steps=2, pool=4)

    assert fig.error == ""
    # From the first training rollout (5) to step 2's commit (60).
    assert (fig.status, fig.steps, fig.phase_s) == ("completed", 2, pytest.approx(55.0))
    assert (fig.finished, fig.trained) == (1, 8)
    # Boxes closed inside the phase: rollouts 1 (26 s, steps 7..15 = 8 s) and 2 (10 s, none).
    assert (fig.boxes, fig.lifetime_s, fig.busy_s) == (2, pytest.approx(36.0), pytest.approx(8.0))
    assert fig.box_util == pytest.approx(8 / 36)
    # The pool: 8 s of rollout 1 and rollout 3's 55..60 inside the phase, over 4 boxes x 55 s.
    assert fig.pool_util == pytest.approx(13 / 220)
    assert (fig.rejected, fig.dropped, fig.cancelled, fig.lost) == ({"gateway_error": 1}, 1, 1, 2)
    assert fig.accepted_min == 0.75
    assert fig.rejected_stats == {"rollout/cua/rejected/gateway_error": [0.25, 0.25]}
    assert (fig.wait_s, fig.train_s) == (pytest.approx(20.0), pytest.approx(10.0))
    assert fig.per_min(fig.finished) == pytest.approx(60 / 55)


def test_a_run_without_step_times_is_an_error(bench, tmp_path):
    _run_db(tmp_path / "monitor.db")
    db = sqlite3.connect(tmp_path / "monitor.db")
    db.execute("UPDATE turn SET end_time = start_time")  # what recording after the episode gave
    db.commit()
    db.close()
    fig = bench.read_run(bench.RunFigures(0, tmp_path, 0, 0.0), steps=2, pool=4)
    assert "no step times" in fig.error


def _figures(bench, mode: str, k: int, *, phase_s: float, finished: int, busy: float):
    """A finished run's figures, set by hand: 4 boxes of 10 s each, a pool of 4."""
    fig = bench.RunFigures(k, Path(mode), 0, 0.0, mode)
    fig.steps, fig.status, fig.phase_s, fig.pool = 2, "completed", phase_s, 4
    fig.finished, fig.trained = finished, finished
    fig.boxes, fig.lifetime_s, fig.busy_s = 4, 40.0, busy
    fig.pool_held_s, fig.pool_busy_s = 40.0, busy
    return fig


def test_the_builtin_mode_is_reported_against_the_service_at_the_same_staleness(bench):
    args = argparse.Namespace(
        steps=2, batch_size=2, group_size=2, box_startup=2.0, step_latency=1.0,
        agent_steps=3, concurrency=2, model="m",
    )  # fmt: skip
    figs = [
        _figures(bench, "service", 1, phase_s=60.0, finished=6, busy=20.0),
        # Twice the episodes in the same time, boxes busy 30 of their 40 s instead of 20.
        _figures(bench, "builtin", 1, phase_s=60.0, finished=12, busy=30.0),
    ]
    lines = bench.report(figs, args)
    line = next(x for x in lines if x.startswith("builtin / service at offpol 1:"))
    assert "ep/min 2.00x" in line and "box util 1.50x" in line, line
    assert "episodes lost 0 vs 0" in line
    rows = [x for x in lines if x.split()[:2] in (["service", "1"], ["builtin", "1"])]
    assert len(rows) == 2, lines
