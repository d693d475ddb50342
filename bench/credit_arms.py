"""Step credit's own figures per run: success per step from the monitor's rollouts, and the
step groups the group filter formed (docs/learning.md, *Step credit*).

For each run folder written by ``python -m cua_rl.app.learn`` (its ``monitor.db``): the success
rate of each step's rollouts (each episode under the step it was recorded for: an asynchronous
run's committed steps do not all export a success rate), the first step at which the trailing
mean of ``--window`` steps reaches ``--target``, and, when the run had step credit on, its
``cua/credit`` statistics averaged over the steps that exported them: the share of steps in step
groups of 2 or more, the mean and largest step group size, false merges per group, episodes
whose steps were unknown to the filter, and the mean absolute step advantage. Then, per arm, the
steps to the target of its runs and their median (a run that never reached it counts as later
than any that did). ``--out`` plots these curves, a panel per arm (docs/img/learn-long-arms.png).

    python bench/credit_arms.py --arm "full, episode" runs/long-full-episode-s{1,2,3} \\
        --arm "full, step" runs/long-full-step-s{1,2,3} --out runs/long-arms.png
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cua_rl.app.learning_curves import StepPoint, plot_arms  # noqa: E402

CREDIT = (
    "grouped_share",
    "step_group_size",
    "step_group_size_max",
    "false_merges",
    "unknown_episodes",
    "step_advantage_abs",
)


def success_per_step(db: Path) -> list[tuple[int, float, int]]:
    """(step, success rate, episodes) of the latest training's completed step rollouts."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        training = con.execute("SELECT id FROM training ORDER BY id DESC LIMIT 1").fetchone()
        rows = con.execute(
            "SELECT s.step, AVG(COALESCE(r.task_success, 0)), COUNT(*) FROM rollout r "
            "JOIN step s ON r.step_id = s.id WHERE s.training_id = ? AND r.status = 'completed' "
            "GROUP BY s.step ORDER BY s.step",
            (training[0],),
        ).fetchall()
    finally:
        con.close()
    return [(int(s), float(rate), int(n)) for s, rate, n in rows]


def credit_stats(db: Path) -> dict[str, float]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        found: dict[str, list[float]] = {k: [] for k in CREDIT}
        for (metrics,) in con.execute("SELECT metrics_json FROM step"):
            values = json.loads(metrics or "{}")
            for key in CREDIT:
                value = values.get(f"rollout/cua/credit/{key}")
                if isinstance(value, int | float):
                    found[key].append(float(value))
    finally:
        con.close()
    return {k: statistics.mean(v) for k, v in found.items() if v}


def reached(curve: list[tuple[int, float, int]], target: float, window: int) -> int | None:
    rates = [rate for _, rate, _ in curve]
    for i in range(window - 1, len(rates)):
        if statistics.mean(rates[i - window + 1 : i + 1]) >= target:
            return curve[i][0]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", nargs="+", action="append", required=True,
                        metavar=("NAME", "RUN_DIR"), help="an arm's name, then its run folders")  # fmt: skip
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--out", type=Path, help="a PNG of every run's curve, a panel per arm")
    args = parser.parse_args(argv)
    arms: dict[str, list[int | None]] = {}
    curves: dict[str, dict[str, list[StepPoint]]] = {}
    for name, *dirs in args.arm:
        arms[name] = []
        curves[name] = {}
        for d in map(Path, dirs):
            curve = success_per_step(d / "monitor.db")
            curves[name][d.name] = [
                StepPoint(step, rate, None, n, None, None) for step, rate, n in curve
            ]
            at = reached(curve, args.target, args.window)
            arms[name].append(at)
            stats = credit_stats(d / "monitor.db")
            rates = " ".join(f"{rate:.2f}" for _, rate, _ in curve)
            print(f"{name:<16} {d.name:<26} reached {'never' if at is None else at:>5}  {rates}")
            if stats:
                print(
                    f"{'':<16} {'':<26} grouped {stats['grouped_share']:.2f}, step group "
                    f"size {stats['step_group_size']:.1f} (largest "
                    f"{stats['step_group_size_max']:.1f}), false merges "
                    f"{stats['false_merges']:.2f}/group, unknown episodes "
                    f"{stats['unknown_episodes']:.2f}/group, |step advantage| "
                    f"{stats['step_advantage_abs']:.3f}"
                )
    print()
    for name, runs in arms.items():
        # A run that never reached the target is later than any that did.
        order = sorted(float("inf") if r is None else r for r in runs)
        mid = statistics.median(order)
        median = None if mid == float("inf") else mid
        shown = ",".join("never" if r is None else str(r) for r in runs)
        print(
            f"{name:<16} reached at {shown:<16} median {'never' if median is None else f'{median:g}'}"
        )
    if args.out:
        print(f"plot: {plot_arms(curves, args.out, target=args.target)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
