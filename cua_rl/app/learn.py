"""``make learn``: train the tiny model on the learn task family and plot its success per step.

Each run is ``make demo``'s launcher (monitor, local gym, local agent, then train.py) on
``configs/learn.yaml``, quiet, while a thread reads the monitor's database and prints one line
per committed step. After a run it prints the success rate per step, writes ``success.png`` and
``curve.json`` into the run's folder, and says at which step the trailing mean first reached the
target. Several values of ``--offpolicyness`` or ``--seeds`` run one after another (folders
``<run-dir>/<label>``) and end with a table and one plot of every curve. ``--control`` trains the
negative control (cua_rl/app/controls.py) instead, which must not learn. ``--family learn2``
trains the two-step family (configs/learn2.yaml), ``--family learn-hard`` the one whose chance
rate is about 1 in 80 (configs/learn-hard.yaml), ``--family learn-long`` the 8-step setup wizard
(configs/learn-long.yaml); ``--context`` picks the local agent's context policy (full, mai-ui,
current; docs/agent.md). ``--replay on`` puts recorded successes into all-fail groups
(cua_rl/warehouse/replay.py), ``--replay shuffled`` is its control. ``--credit step`` adds step
credit from screen states (cua_rl/credit), ``--credit episode`` states the default.

    python -m cua_rl.app.learn [--family learn|learn2|learn-hard|learn-long] [--context POLICY]
        [--history-n N] [--offpolicyness 0 1 2] [--seeds 1 2 3] [--steps N]
        [--control [shifted-credit|shifted-mask]] [--replay on|shuffled] [--credit episode|step]
        [--stop-at-target] [--run-dir DIR] [key=value overrides for train.py]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from cua_rl.app import demo
from cua_rl.app.learning_curves import (
    ArmSummary,
    CurveError,
    StepPoint,
    before_step,
    first_last,
    format_curve,
    group_shares,
    plot_curves,
    read_curve,
    steps_to_reach,
    successes,
    summarise_arm,
)

ROOT = Path(__file__).resolve().parents[2]
# --control NAME: the negative controls' workflows (cua_rl/app/controls.py; docs/learning.md).
CONTROLS = {
    "shifted-credit": "cua_rl.app.controls.ShiftedCreditWorkflow",
    "shifted-mask": "cua_rl.app.controls.ShiftedMaskWorkflow",
}
# The config of each task family (docs/learning.md); --config still wins when given.
FAMILY_CONFIGS = {
    "learn": "configs/learn.yaml",
    "learn2": "configs/learn2.yaml",
    "learn-hard": "configs/learn-hard.yaml",
    "learn-long": "configs/learn-long.yaml",
}
CONTEXTS = ("full", "mai-ui", "current")
# --replay: the train.py overrides of each arm (cua_rl/warehouse/replay.py).
REPLAY_ARMS = {
    "on": ["replay.enabled=true"],
    "shuffled": ["replay.enabled=true", "replay.shuffle_rewards=true"],
}
# --credit: episode credit (every token its episode's advantage) or step credit besides it
# (cua_rl/credit, docs/credit.md).
CREDIT_ARMS = {"episode": ["step_credit.enabled=false"], "step": ["step_credit.enabled=true"]}


@dataclass
class RunResult:
    label: str
    run_dir: Path
    rc: int
    wall_s: float
    points: list[StepPoint]
    # The step at which --stop-at-target ended the run (None: it ran its steps).
    stopped_at: int | None = None


@dataclass(frozen=True)
class StopAt:
    """``--stop-at-target``: end the run once ``window`` committed steps average ``target``."""

    target: float
    window: int


class Progress(threading.Thread):
    """Prints each newly committed step of the run whose monitor database is ``db_path``; with
    ``stop_at``, sets ``stop`` (the launcher then ends the run) once the target is reached."""

    def __init__(
        self,
        db_path: Path,
        label: str,
        total: int | None,
        interval_s: float = 2.0,
        stop_at: StopAt | None = None,
    ):
        super().__init__(name="learn-progress", daemon=True)
        self.db_path, self.label, self.total = db_path, label, total
        self.interval_s = interval_s
        self.shown = 0
        self._halt = threading.Event()
        self.stop_at = stop_at
        self.stop = threading.Event()
        # The step at which the target was reached, when that ended the run.
        self.stopped_at: int | None = None

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        try:
            points = read_curve(self.db_path)
        except CurveError:
            return  # not created yet, or busy: the next poll sees it
        for p in points[self.shown :]:
            of = f"/{self.total}" if self.total else ""
            solved = round(p.success * p.episodes) if p.success is not None and p.episodes else 0
            when = f"{p.elapsed_s:.0f}s" if p.elapsed_s is not None else "-"
            success = f"{p.success:.3f}" if p.success is not None else "-"
            print(
                f"[learn] {self.label} step {p.step}{of}: success {success} "
                f"({solved}/{p.episodes}) at {when}",
                flush=True,
            )
        self.shown = max(self.shown, len(points))
        if self.stop_at is None or self.stop.is_set():
            return
        reached = steps_to_reach(points, self.stop_at.target, self.stop_at.window)
        if reached is not None:
            self.stopped_at = reached
            print(
                f"[learn] {self.label}: target {self.stop_at.target} reached at step {reached}: "
                "stopping the run (--stop-at-target)",
                flush=True,
            )
            self.stop.set()

    def halt(self) -> None:
        self._halt.set()
        self.join(timeout=10)
        self.poll()


def run_one(
    label: str,
    run_dir: Path,
    demo_args: list[str],
    total: int | None,
    stop_at: StopAt | None = None,
) -> RunResult:
    print(f"[learn] {label}: {run_dir}", flush=True)
    progress = Progress(run_dir / "monitor.db", label, total, stop_at=stop_at)
    progress.start()
    t0 = time.monotonic()
    try:
        rc = demo.main(["--quiet", "--run-dir", str(run_dir), *demo_args], stop=progress.stop)
    finally:
        progress.halt()
    wall = time.monotonic() - t0
    try:
        points = read_curve(run_dir / "monitor.db")
    except CurveError as exc:
        print(f"[learn] {label}: no curve ({exc})", flush=True)
        points = []
    return RunResult(label, run_dir, rc, wall, points, progress.stopped_at)


def report(result: RunResult, target: float, window: int) -> dict:
    """Prints one run's curve and writes its plot and numbers into its folder."""
    points = result.points
    summary: dict = {
        "label": result.label,
        "exit_code": result.rc,
        "wall_s": round(result.wall_s, 1),
        "steps": len(points),
        "success": [p.success for p in points],
        "target": target,
        "window": window,
        "reached_at_step": steps_to_reach(points, target, window),
        "stopped_at_target": result.stopped_at,
    }
    for line in format_curve(points):
        print(f"[learn]   {line}", flush=True)
    if len(successes(points)) >= 2 * window:
        first, last = first_last(points, window)
        summary.update(first_mean=round(first, 4), last_mean=round(last, 4))
    staleness = [p.staleness for p in points if p.staleness is not None]
    if staleness:
        summary["mean_staleness"] = round(sum(staleness) / len(staleness), 3)
    # Zero variance before the target (a solved task's groups all succeed, no variance either);
    # all-fail groups and their rescue over the whole run.
    before, whole = (
        group_shares(before_step(points, summary["reached_at_step"])),
        group_shares(points),
    )
    for name, value in (
        ("zero_variance_share", before.zero_variance),
        ("all_fail_share", whole.all_fail),
        ("rescued_share", whole.rescued),
    ):
        if value is not None:
            summary[name] = round(value, 3)
    if points:
        png = plot_curves(
            {result.label: points},
            result.run_dir / "success.png",
            title=f"{result.label}: success rate per step",
            target=target,
        )
        summary["plot"] = str(png)
    (result.run_dir / "curve.json").write_text(
        json.dumps({**summary, "points": [asdict(p) for p in points]}, indent=2)
    )
    reached = summary["reached_at_step"]
    print(
        f"[learn] {result.label}: exit {result.rc}, {result.wall_s:.0f}s, "
        + (
            f"success {summary['first_mean']:.2f} in the first {window} steps -> "
            f"{summary['last_mean']:.2f} in the last {window}, "
            if "first_mean" in summary
            else ""
        )
        + (
            f"target {target} (mean of {window} steps) reached at step {reached}"
            if reached is not None
            else f"target {target} not reached"
        )
        + (
            f"; zero-variance groups before the target {summary['zero_variance_share']:.2f}"
            if "zero_variance_share" in summary
            else ""
        )
        + (
            f", all-fail groups rescued by replay {summary['rescued_share']:.2f}"
            if "rescued_share" in summary
            else ""
        )
        + ("; stopped there (--stop-at-target)" if result.stopped_at is not None else "")
        + (f"; plot {summary['plot']}" if "plot" in summary else ""),
        flush=True,
    )
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = demo.launcher_parser(
        "python -m cua_rl.app.learn", __doc__, "configs/learn.yaml", "runs/learn-<time>"
    )
    parser.add_argument(
        "--offpolicyness",
        type=int,
        nargs="+",
        default=None,
        help="rollout.max_head_offpolicyness values to run (default: the config's)",
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="seeds to run (default: the config's)"
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per run")
    parser.add_argument(
        "--family",
        choices=sorted(FAMILY_CONFIGS),
        default="learn",
        help="task family: learn (one tap), learn2 (two taps in sequence), learn-hard (one "
        "tap on a 10x10 grid: chance rarely succeeds) or learn-long (an 8-step setup wizard "
        "with a trap page); picks its config",
    )
    parser.add_argument(
        "--context",
        choices=CONTEXTS,
        default=None,
        help="the local agent's context policy (agent.context; default: the agent's own, full)",
    )
    parser.add_argument(
        "--history-n",
        type=int,
        default=None,
        help="screenshots per request of the mai-ui context (agent.history_n)",
    )
    parser.add_argument(
        "--control",
        nargs="?",
        const="shifted-credit",
        choices=CONTROLS,
        default=None,
        help="train a negative control instead (cua_rl/app/controls.py): shifted-credit (the "
        "default: each episode gets the next one's reward, which cannot learn) or shifted-mask "
        "(the loss mask one token late)",
    )
    parser.add_argument(
        "--replay",
        choices=REPLAY_ARMS,
        default=None,
        help="replay recorded successes into all-fail groups (on), or the control whose "
        "replayed episodes' credit is shuffled within the group (shuffled); docs/learning.md",
    )
    parser.add_argument(
        "--credit",
        choices=CREDIT_ARMS,
        default=None,
        help="episode: every token its episode's advantage (the default); step: each step's "
        "advantage from its screen state added (step_credit.enabled; docs/credit.md)",
    )
    parser.add_argument("--target", type=float, default=0.8, help="success rate a run should reach")
    parser.add_argument(
        "--window", type=int, default=3, help="steps averaged for the target and the summaries"
    )
    parser.add_argument(
        "--stop-at-target",
        action="store_true",
        help="end each run once it reaches --target (the mean of --window steps; the training "
        "is then recorded cancelled); a run that does not reach it trains all its steps",
    )
    parser.add_argument(
        "--step-latency",
        type=float,
        default=0.0,
        help="seconds the local agent waits after each action (the demo's option)",
    )
    parser.add_argument(
        "--gym-args",
        default="",
        help="extra options for the local gym (the demo's option); configs/miniwob-learn.yaml "
        "names the ones it needs",
    )
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    if not 0.0 < args.target <= 1.0:
        parser.error("--target must be a success rate in (0, 1]")
    if args.window < 1:
        parser.error("--window must be at least 1")
    if args.history_n is not None and args.history_n < 1:
        parser.error("--history-n must be at least 1")
    if args.config == FAMILY_CONFIGS["learn"]:
        args.config = FAMILY_CONFIGS[args.family]
    return args


def agent_overrides(args: argparse.Namespace) -> list[str]:
    """train.py overrides for the context flags."""
    out = []
    if args.context is not None:
        out.append(f"agent.context={args.context}")
    if args.history_n is not None:
        out.append(f"agent.history_n={args.history_n}")
    return out


def print_table(summaries: list[dict]) -> None:
    print(
        "[learn] label                      exit   wall  first  last  zero-var  rescued  "
        "target reached at"
    )
    for s in summaries:
        first = f"{s['first_mean']:.2f}" if "first_mean" in s else "  - "
        last = f"{s['last_mean']:.2f}" if "last_mean" in s else "  - "
        zero = f"{s['zero_variance_share']:.2f}" if "zero_variance_share" in s else "  - "
        rescued = f"{s['rescued_share']:.2f}" if "rescued_share" in s else "  - "
        reached = s["reached_at_step"] if s["reached_at_step"] is not None else "never"
        print(
            f"[learn] {s['label']:<26} {s['exit_code']:>4} {s['wall_s']:>5.0f}s  "
            f"{first}  {last}  {zero:>8}  {rescued:>7}  step {reached}"
        )


def run_label(args: argparse.Namespace, off: int | None, seed: int | None) -> str:
    """A run's name (its folder among several); without a seed, its arm's."""
    parts = [f"control-{args.control}"] if args.control else []
    parts += [args.family] if args.family != "learn" else []
    parts += [f"replay-{args.replay}"] if args.replay else []
    parts += [f"credit-{args.credit}"] if args.credit else []
    parts += [f"context-{args.context}"] if args.context else []
    parts += [f"offpolicy{off}"] if off is not None else []
    parts += [f"seed{seed}"] if seed is not None else []
    return "-".join(parts) or args.family


def format_arm(label: str, arm: ArmSummary, target: float) -> str:
    """One line for several seeds of one setting: the median steps to the target, pooled shares."""
    reached = ", ".join("never" if r is None else str(r) for r in arm.reached)
    median = "never" if arm.median_reached is None else f"step {arm.median_reached:g}"
    line = (
        f"[learn] {label}: {arm.runs} runs, target {target} reached at {reached}: median {median}"
    )
    if arm.before_target.zero_variance is not None:
        line += f"; zero-variance groups before the target {arm.before_target.zero_variance:.2f}"
    if arm.whole.rescued is not None:
        line += (
            f"; all-fail groups {arm.whole.all_fail:.2f} of all, "
            f"rescued by replay {arm.whole.rescued:.2f} of them"
        )
    return line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = (ROOT / (args.run_dir or f"runs/learn-{stamp}")).resolve()
    offs = args.offpolicyness or [None]
    seeds = args.seeds or [None]
    combos = list(itertools.product(offs, seeds))
    common = ["--config", args.config, "--step-latency", str(args.step_latency)]
    common += ["--agent-mode", args.agent_mode]
    if args.gym_args:
        common += ["--gym-args", args.gym_args]
    extra = [*agent_overrides(args), *args.overrides]
    if args.steps is not None:
        extra.append(f"total_train_steps={args.steps}")
    if args.control:
        extra.append(f"workflow={CONTROLS[args.control]}")
    if args.replay:
        extra += REPLAY_ARMS[args.replay]
    if args.credit:
        extra += CREDIT_ARMS[args.credit]

    results = []
    for off, seed in combos:
        label = run_label(args, off, seed)
        run_dir = base / label if len(combos) > 1 else base
        overrides = list(extra)
        if off is not None:
            overrides.append(f"rollout.max_head_offpolicyness={off}")
        if seed is not None:
            overrides.append(f"seed={seed}")
        stop_at = StopAt(args.target, args.window) if args.stop_at_target else None
        result = run_one(label, run_dir, [*common, *overrides], args.steps, stop_at)
        results.append(result)
        if result.rc == 130:  # interrupted: do not start the next run
            break

    summaries = [report(r, args.target, args.window) for r in results]
    if len(results) > 1:
        print_table(summaries)
        curves = {r.label: r.points for r in results if r.points}
        if curves:
            png = plot_curves(curves, base / "success.png", target=args.target)
            print(f"[learn] all curves: {png}", flush=True)
        (base / "summary.json").write_text(json.dumps(summaries, indent=2))
    for off in offs if len(seeds) > 1 else []:
        # One arm per --offpolicyness value: its seeds' runs.
        runs = [r.points for r, (o, _) in zip(results, combos, strict=False) if o == off]
        if len(runs) > 1:
            arm = summarise_arm(runs, args.target, args.window)
            print(format_arm(run_label(args, off, None), arm, args.target), flush=True)
    return max((r.rc for r in results), default=1)


if __name__ == "__main__":
    sys.exit(main())
