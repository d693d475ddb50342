"""Learning curves: the success rate per training step, read back from the monitor's database.

A run's proof of learning is its training rollouts' success rate per step (the
``rollout/cua/success`` statistic each committed step stores in ``step.metrics_json``, the
number the dashboard plots). This module reads that curve from a monitor SQLite file, condenses
it (the mean of the first and last steps, the first step whose trailing window reaches a target)
and draws one or more curves into a PNG. Several seeds of one arm (a setting compared with
another, e.g. replay on or off) condense into an ``ArmSummary``: the median step at which the
seeds reach the target and the group shares pooled over every seed's steps. It only reads: the monitor process may still be writing,
so a locked or half-written database yields the steps committed so far.

``python -m cua_rl.app.learn`` (``make learn``) drives runs and prints these summaries;
docs/learning.md has the task family and the measured curves.
"""

from __future__ import annotations

import json
import math
import sqlite3
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cua_rl.errors import CuaRlError
from cua_rl.monitor.server.read import MonitorReader

SUCCESS_KEY = "rollout/cua/success"
REWARD_KEY = "rollout/cua/reward"
STALENESS_KEY = "ppo_actor/update/version_stats/sample_staleness_theta_avg"
ZERO_VARIANCE_KEY = "rollout/cua/group/zero_variance"
ALL_FAIL_KEY = "rollout/cua/replay/all_fail"
RESCUED_KEY = "rollout/cua/replay/rescued"


class CurveError(CuaRlError):
    """A database without the run or the steps asked for."""


@dataclass(frozen=True)
class StepPoint:
    """One committed training step of a run."""

    step: int
    success: float | None  # share of the step's accepted episodes the gym judged solved
    reward: float | None
    episodes: int | None  # episodes the step trained on (whole groups)
    elapsed_s: float | None  # from the training's start to the step's commit
    staleness: float | None  # mean policy versions between sampling and the update
    # Shares of the step's complete groups: with equal episode rewards after replay (no
    # gradient); that failed entirely before replay (replay on); of those, rescued by replay.
    zero_variance: float | None = None
    all_fail: float | None = None
    rescued: float | None = None


def _time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def read_curve(db_path: str | Path, run_name: str | None = None) -> list[StepPoint]:
    """The committed steps of ``run_name`` (default: the database's latest training), in order.

    Raises CurveError when the file or the training is missing; a training with no committed
    step yet gives an empty list.
    """
    path = Path(db_path)
    if not path.is_file():
        raise CurveError(f"no monitor database at {path}; did the run start?")
    db = MonitorReader(path, timeout_s=5.0)
    try:
        try:
            training = db.latest_training(run_name)
        except sqlite3.OperationalError as exc:  # schema not created yet, or locked
            raise CurveError(f"{path} cannot be read yet: {exc}") from exc
        if training is None:
            which = f"training {run_name!r}" if run_name else "any training"
            raise CurveError(f"{path} has no record of {which}")
        started = _time(training["start_time"])
        rows = db.completed_steps(training["id"])
    finally:
        db.close()
    points = []
    for row in rows:
        step, n, end, metrics = (
            row[k] for k in ("step", "num_trajectories", "end_time", "metrics_json")
        )
        try:
            stats = json.loads(metrics or "{}")
        except ValueError:
            stats = {}
        ended = _time(end)
        elapsed = (ended - started).total_seconds() if ended and started else None
        points.append(
            StepPoint(
                step=int(step),
                success=_number(stats.get(SUCCESS_KEY)),
                reward=_number(stats.get(REWARD_KEY)),
                episodes=int(n) if n is not None else None,
                elapsed_s=elapsed,
                staleness=_number(stats.get(STALENESS_KEY)),
                zero_variance=_number(stats.get(ZERO_VARIANCE_KEY)),
                all_fail=_number(stats.get(ALL_FAIL_KEY)),
                rescued=_number(stats.get(RESCUED_KEY)),
            )
        )
    return points


def measured(points: Sequence[StepPoint]) -> list[StepPoint]:
    """The steps that carry a success rate, in order.

    A step stores the statistics exported since the previous one, not those of the batch it
    trained: in an asynchronous run a step whose whole batch finished before the previous
    export stores no success rate at all. Such a step is unknown, not "nothing solved", so the
    summaries skip it rather than count it as 0.
    """
    return [p for p in points if p.success is not None]


def successes(points: Sequence[StepPoint]) -> list[float]:
    """The success rates of the measured steps, in step order."""
    return [p.success for p in measured(points)]


def mean_of(values: Sequence[float]) -> float:
    if not values:
        raise CurveError("no steps to average; run more steps")
    return sum(values) / len(values)


def first_last(points: Sequence[StepPoint], k: int) -> tuple[float, float]:
    """Mean success of the first ``k`` and of the last ``k`` steps (they must not overlap)."""
    if k < 1:
        raise CurveError(f"window k={k} must be at least 1")
    s = successes(points)
    if len(s) < 2 * k:
        raise CurveError(f"{len(s)} measured steps cannot give two disjoint windows of {k}")
    return mean_of(s[:k]), mean_of(s[-k:])


def steps_to_reach(points: Sequence[StepPoint], target: float, window: int = 3) -> int | None:
    """The first step whose trailing ``window`` steps average at least ``target`` success."""
    if window < 1:
        raise CurveError(f"window={window} must be at least 1")
    known = measured(points)
    s = successes(known)
    for i in range(window - 1, len(s)):
        if mean_of(s[i - window + 1 : i + 1]) >= target:
            return known[i].step
    return None


def _pooled(pairs: Sequence[tuple[float, float]]) -> float | None:
    """The mean of shares weighted by how many units each was taken over; None without units."""
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total > 0 else None


@dataclass(frozen=True)
class GroupShares:
    """The group statistics of some steps, pooled: each step's shares weighted by its episodes.

    AReaL exports a share per step (the mean of one 0/1 value per group), not how many groups it
    was taken over, so a step's groups are taken to be in proportion to the episodes it trained
    (its whole groups); with a fixed group size the pooled share is then the share of all groups.
    """

    zero_variance: float | None  # of the complete groups: equal rewards after replay
    all_fail: float | None  # of the complete groups: every episode failed before replay
    rescued: float | None  # of those all-fail groups: got a replayed success (a gradient)
    episodes: int  # behind the shares: groups = episodes / group size


def group_shares(points: Sequence[StepPoint]) -> GroupShares:
    """Pools the group shares of ``points``; a step without a statistic adds nothing to it.

    A step that stores ``all_fail`` but no ``rescued`` had replay on and no all-fail group (the
    filter records ``rescued`` only for those), or replay off: either way it rescued none.
    """
    zero, fail, rescued, episodes = [], [], [], 0
    for p in points:
        weight = float(p.episodes or 0)
        if p.zero_variance is not None:
            zero.append((p.zero_variance, weight))
            episodes += p.episodes or 0
        if p.all_fail is not None:
            fail.append((p.all_fail, weight))
            rescued.append((p.rescued or 0.0, p.all_fail * weight))
    return GroupShares(
        zero_variance=_pooled(zero),
        all_fail=_pooled(fail),
        rescued=_pooled(rescued),
        episodes=episodes,
    )


def before_step(points: Sequence[StepPoint], step: int | None) -> list[StepPoint]:
    """The points before ``step`` (all of them when it is None: the target was never reached).

    Once a policy solves its tasks every group succeeds entirely and has no variance either; the
    share that tells arms apart is the one while there is still something to learn.
    """
    return [p for p in points if step is None or p.step < step]


def from_first_success(points: Sequence[StepPoint]) -> list[StepPoint]:
    """The points from the first step with a success on (none when nothing succeeded): before it
    replay has no success of this training to put into an all-fail group."""
    first = next((i for i, p in enumerate(points) if p.success), len(points))
    return list(points[first:])


def median_step(reached: Sequence[int | None]) -> float | None:
    """The median step at which runs reached a target; a run that never did counts as later than
    any that did, so the median is None when half the runs or more never reached it."""
    if not reached:
        raise CurveError("no runs to take a median of")
    ranked = sorted(math.inf if r is None else float(r) for r in reached)
    middle = statistics.median(ranked)
    return None if math.isinf(middle) else middle


@dataclass(frozen=True)
class ArmSummary:
    """Several runs (seeds) of one arm of a comparison."""

    runs: int
    reached: list[int | None]  # per run, in the order given
    median_reached: float | None  # None: the median run never reached the target
    before_target: GroupShares  # pooled over each run's steps before it reached the target
    whole: GroupShares  # pooled over every step of every run


def summarise_arm(
    runs: Sequence[Sequence[StepPoint]], target: float, window: int = 3
) -> ArmSummary:
    """The median steps to ``target`` (trailing mean of ``window`` steps) and the pooled shares."""
    if not runs:
        raise CurveError("an arm needs at least one run")
    reached = [steps_to_reach(points, target, window) for points in runs]
    before = [p for points, r in zip(runs, reached, strict=True) for p in before_step(points, r)]
    return ArmSummary(
        runs=len(runs),
        reached=reached,
        median_reached=median_step(reached),
        before_target=group_shares(before),
        whole=group_shares([p for points in runs for p in points]),
    )


def format_curve(points: Sequence[StepPoint]) -> list[str]:
    """One line per step: success, reward, episodes, time since the start."""
    lines = []
    for p in points:
        success = f"{p.success:.3f}" if p.success is not None else "  -  "
        reward = f"{p.reward:.3f}" if p.reward is not None else "-"
        when = f"{p.elapsed_s:6.0f}s" if p.elapsed_s is not None else "     -"
        bar = "#" * round(20 * (p.success or 0.0))
        lines.append(
            f"step {p.step:3d}  success {success}  reward {reward}  episodes {p.episodes}  "
            f"{when}  {bar}"
        )
    return lines


def _draw(
    ax,
    curves: Mapping[str, Sequence[StepPoint]],
    title: str,
    target: float | None,
    legend: str = "lower right",
):
    from matplotlib.ticker import MaxNLocator

    for label, points in curves.items():
        if points:
            ax.plot(
                [p.step for p in measured(points)], successes(points), marker="o", ms=3, label=label
            )
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylim(-0.03, 1.03)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc=legend, fontsize=8)


def _save(fig, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    return out


def _figure(panels: int, width: float):
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(width, 4), dpi=110, sharey=True, squeeze=False)
    axes[0][0].set_ylabel("success rate of the step's episodes")
    return plt, fig, axes[0]


def plot_curves(
    curves: Mapping[str, Sequence[StepPoint]],
    path: str | Path,
    *,
    title: str = "success rate per step",
    target: float | None = None,
) -> Path:
    """Draw each labelled curve (success per step) into a PNG at ``path``."""
    if not curves or not any(curves.values()):
        raise CurveError("no committed steps to plot")
    plt, fig, (ax,) = _figure(1, 7)
    try:
        _draw(ax, curves, title, target)
        return _save(fig, path)
    finally:
        plt.close(fig)


def plot_arms(
    arms: Mapping[str, Mapping[str, Sequence[StepPoint]]],
    path: str | Path,
    *,
    target: float | None = None,
) -> Path:
    """One panel per arm, each with its runs' curves, side by side on one success axis."""
    if not arms or not all(any(curves.values()) for curves in arms.values()):
        raise CurveError("every arm needs a run with committed steps to plot")
    plt, fig, axes = _figure(len(arms), 4.5 * len(arms))
    try:
        for ax, (arm, curves) in zip(axes, arms.items(), strict=True):
            # Rising curves leave the left middle empty: runs that learn start at 0.
            _draw(ax, curves, arm, target, legend="center left")
        return _save(fig, path)
    finally:
        plt.close(fig)
