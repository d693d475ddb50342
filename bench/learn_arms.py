"""Learning curves of several arms, several seeds each: the table and the plot docs/learning.md shows.

Each arm is a setting (replay off, on, its shuffled control) and a list of run folders written by
``python -m cua_rl.app.learn`` (one seed each). For every run it reads the curve from the run's
``monitor.db`` (the wall time from its ``curve.json``) and prints the first step with a success,
the step at which the trailing mean of ``--window`` steps first reached ``--target``, the last
window's mean, and the group shares: groups with zero variance before the target, all-fail
groups, and the share of those that replay rescued (gave a gradient), over the whole run and from
its first success on (before it, replay has nothing of the run's own to put in). For every arm: the median step to the target over its
runs and the shares pooled over them (``cua_rl.app.learning_curves.summarise_arm``). The counts of
groups are the shares times the episodes over ``--group-size`` (AReaL exports shares per step).
One PNG has a panel per arm with its runs' curves.

    python bench/learn_arms.py --arm "no replay" runs/hard-none-s2 runs/hard-none-s3 \\
        --arm replay runs/hard-on-s2 runs/hard-on-s3 --out runs/hard-arms.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cua_rl.app.learning_curves import (  # noqa: E402
    GroupShares,
    StepPoint,
    before_step,
    from_first_success,
    group_shares,
    plot_arms,
    read_curve,
    steps_to_reach,
    successes,
    summarise_arm,
)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _groups(shares: GroupShares, group_size: int) -> str:
    """All-fail groups rescued, as counts: 'rescued of all-fail (share)'."""
    if shares.all_fail is None:
        return "-"
    fail = shares.all_fail * shares.episodes / group_size
    rescued = shares.rescued or 0.0  # None: no all-fail group to rescue
    return f"{rescued * fail:.0f} of {fail:.0f} ({_share(shares.rescued)})"


def _wall(run_dir: Path) -> float | None:
    curve = run_dir / "curve.json"
    return json.loads(curve.read_text()).get("wall_s") if curve.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arm",
        nargs="+",
        action="append",
        required=True,
        metavar=("NAME", "RUN_DIR"),
        help="an arm's name, then its run folders (repeat for each arm)",
    )
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=12, help="gconfig.n_samples")
    parser.add_argument("--out", type=Path, default=None, help="the PNG (default: none)")
    args = parser.parse_args(argv)
    if any(len(arm) < 2 for arm in args.arm):
        parser.error("each --arm needs a name and at least one run folder")
    for name, *dirs in args.arm:
        if len({Path(d).name for d in dirs}) != len(dirs):
            parser.error(f"arm {name!r} names a run folder twice: {dirs}")

    curves: dict[str, dict[str, list[StepPoint]]] = {}
    print(
        f"{'arm':<12} {'run':<22} first  reached  last  zero-var  all-fail  "
        "rescued (all-fail groups)  from the first success   wall"
    )
    for name, *dirs in args.arm:
        curves[name] = {}
        for d in map(Path, dirs):
            points = read_curve(d / "monitor.db")
            curves[name][d.name] = points
            reached = steps_to_reach(points, args.target, args.window)
            before, whole = group_shares(before_step(points, reached)), group_shares(points)
            last = successes(points)[-args.window :]
            wall = _wall(d)
            # Replay has nothing of its own to put into a group before its first success.
            first = next((p.step for p in points if p.success), "never")
            since = group_shares(from_first_success(points))
            print(
                f"{name:<12} {d.name:<22} {first:>5}  {'never' if reached is None else reached:>7}  "
                f"{statistics.mean(last) if last else 0:.2f}  "
                f"{_share(before.zero_variance):>8}  {_share(whole.all_fail):>8}  "
                f"{_groups(whole, args.group_size):>26}  {_groups(since, args.group_size):>22}  "
                + ("-" if wall is None else f"{wall:.0f}s")
            )
    print()
    print(
        f"{'arm':<12} runs  reached at        median  zero-var  all-fail  rescued (groups)  "
        "from the first success"
    )
    for name, runs in curves.items():
        arm = summarise_arm(list(runs.values()), args.target, args.window)
        since = group_shares([p for points in runs.values() for p in from_first_success(points)])
        reached = ",".join("never" if r is None else str(r) for r in arm.reached)
        median = "never" if arm.median_reached is None else f"{arm.median_reached:g}"
        print(
            f"{name:<12} {arm.runs:>4}  {reached:<16} {median:>7}  "
            f"{_share(arm.before_target.zero_variance):>8}  {_share(arm.whole.all_fail):>8}  "
            f"{_groups(arm.whole, args.group_size)}  {_groups(since, args.group_size)}"
        )
    if args.out is not None:
        png = plot_arms(curves, args.out, target=args.target)
        print(f"\nplot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
