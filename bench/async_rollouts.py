"""Asynchronous rollouts through the gateway: episodes per minute, box utilisation, episodes lost.

Trains the embedded default once per ``rollout.max_head_offpolicyness`` value (0, 1 and 2 by
default) and agent mode (``--agent-modes``: ``service``, the local agent service, by default;
``builtin``, the rollout workers running the same agent loop themselves) with ``make demo``'s
launcher (``cua_rl/app/demo.py``): the monitor on a SQLite
file, the local gym with a box start-up time (``--box-startup``), the agent with a latency
after every step (``--step-latency``, the same in both modes), vLLM CPU and AReaL's PPOTrainer,
the agent's model calls through the rollout gateway (``endpoint.mode=gateway``). The baseline pass runs first and warms
vLLM up (the first model calls of a run are several times slower); no eval runs between steps.
Everything is then read back from what the run recorded (``<run>/monitor.db``, the rollout
worker's log), and one table and its ratios are printed.

How each figure is computed (times are the monitor's UTC timestamps):

- phase: the training phase, from the first training rollout's ``start_time`` (after the
  baseline) to step N's ``end_time`` (its commit).
- ep/min: training episodes finished in the phase (rollout rows of a step, ``completed``, ending
  inside it) per minute. trained/min: rows the N steps trained on (``ppo_actor/n_seqs`` summed
  over the step rows) per minute; ``trained`` is fixed by the config, so it measures speed.
- box util: over the training episodes' boxes terminated inside the phase, the sum of agent-step
  time over the sum of box lifetimes. A box's lifetime is its environment row's
  ``creation_time`` .. ``termination_time`` (the workflow marks them just before the gym create
  call and once terminate answered, so start-up counts as box time); its agent-step time is the
  union of its turn rows' ``start_time`` .. ``end_time``, which are the agent's own
  ``step_start`` .. ``step_end`` events (screenshot, model call, action, settle).
- pool util: agent-step time inside the phase over ``pool x phase``, where the pool is the boxes
  the run may hold at once (``max_concurrent_rollouts x n_samples``, the same in every run). This
  is the figure comparable to DART's environment utilisation: an idle slot is a box not working.
  occupancy: box lifetime inside the phase over ``pool x phase`` (pool util = occupancy x the
  utilisation of the boxes while they live). box s: mean box lifetime.
- paused: mean seconds an episode's model calls waited in the gateway for a weight update
  (AReaL's ``rollout/cua/gateway/paused_s``). It is inside agent-step time; the ratios "net of
  pauses" count it as idle (boxes x mean pause, an estimate).
- episodes lost = rejected + dropped: ``rejected`` are training rollouts that ended ``failed``
  (listed by reason); ``dropped`` are the group-mates ``complete_groups`` threw out with them (its
  "group rejected: k of G" lines in the rollout worker's log). ``cancel`` counts episodes in
  flight when the run stopped (not lost data: box time spent for nothing). ``acc min`` is
  AReaL's ``rollout/cua/accepted`` at its worst step, and any ``rollout/cua/rejected/*`` stat is
  listed under the table.
- wait / train: the trainer's seconds waiting for batches (``timeperf/rollout``) and computing
  (recompute, advantages, update, weight update), summed over the steps.
- builtin / service: with both modes, each figure of the builtin run over the service run's at
  the same offpolicyness (same box start-up, step latency, pool and steps).

Run it alone: it trains once per value, about 2 minutes each on 2 cores (6 to 7 minutes in all)::

    python bench/async_rollouts.py [--steps 6] [--box-startup 2] [--step-latency 1]
        [--offpolicyness 0 1 2] [--agent-modes service builtin] [--model qwen2-vl-bpe]
        [--concurrency 2] [--runs-dir DIR] [--reread] [key=value ...]

Extra key=value arguments go to every training (train.py overrides). The runs stay under
``runs/bench-async-<time>/offpolicy-<k>/`` (``builtin-offpolicy-<k>/`` for the builtin mode) for
the dashboard (``python -m cua_rl.monitor serve``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from cua_rl.monitor.server.read import MonitorReader

ROOT = Path(__file__).resolve().parents[1]
DART_ENV_UTILISATION = 5.5
GROUP_REJECTED = re.compile(r"group rejected: (\d+) of (\d+) episodes returned rows")
TRAIN_KEYS = (
    "timeperf/recompute_logp",
    "timeperf/compute_advantage",
    "timeperf/train_step",
    "timeperf/update_weights",
)


@dataclass
class RunFigures:
    offpolicyness: int
    run_dir: Path
    rc: int
    wall_s: float
    mode: str = "service"
    status: str = "?"
    phase_s: float = 0.0
    steps: int = 0
    finished: int = 0
    trained: int = 0
    boxes: int = 0
    lifetime_s: float = 0.0
    busy_s: float = 0.0
    pool_busy_s: float = 0.0  # agent-step time inside the phase
    pool_held_s: float = 0.0  # box lifetime inside the phase
    pool_boxes: int = 0  # boxes that worked inside the phase
    pool: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    dropped: int = 0
    cancelled: int = 0
    accepted_min: float | None = None
    rejected_stats: dict[str, list[float]] = field(default_factory=dict)
    wait_s: float = 0.0
    train_s: float = 0.0
    # Mean seconds an episode's model calls waited in the gateway for a weight update (AReaL's
    # rollout/cua/gateway/paused_s, averaged over the steps that exported rollout stats).
    paused_s: float = 0.0
    error: str = ""

    @property
    def minutes(self) -> float:
        return self.phase_s / 60.0

    def per_min(self, n: int) -> float:
        return n / self.minutes if self.minutes > 0 else float("nan")

    @property
    def lost(self) -> int:
        return sum(self.rejected.values()) + self.dropped

    @property
    def box_util(self) -> float:
        return self.busy_s / self.lifetime_s if self.lifetime_s > 0 else float("nan")

    @property
    def box_s(self) -> float:
        return self.lifetime_s / self.boxes if self.boxes else float("nan")

    @property
    def box_util_net(self) -> float:
        """Box utilisation with the gateway's weight-update waits counted as idle (estimated:
        the mean wait per episode times the boxes)."""
        busy = self.busy_s - self.boxes * self.paused_s
        return busy / self.lifetime_s if self.lifetime_s > 0 else float("nan")

    def _of_pool(self, seconds: float) -> float:
        capacity = self.pool * self.phase_s
        return seconds / capacity if capacity > 0 else float("nan")

    @property
    def occupancy(self) -> float:
        return self._of_pool(self.pool_held_s)

    @property
    def pool_util(self) -> float:
        return self._of_pool(self.pool_busy_s)

    @property
    def pool_util_net(self) -> float:
        return self._of_pool(self.pool_busy_s - self.pool_boxes * self.paused_s)


# ---------------------------------------------------------------------------- reading a run


def _t(value: str | None) -> float | None:
    """A monitor timestamp (UTC text) as epoch-like seconds; only differences are used."""
    if not value:
        return None
    return datetime.fromisoformat(value).timestamp()


def union_seconds(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of the intervals, clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if a < end:
            a = end
        if b > a:
            total += b - a
            end = b
    return total


def dropped_from_log(run_dir: Path) -> int:
    dropped = 0
    for path in (run_dir / "areal" / "logs").rglob("rollout.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = GROUP_REJECTED.search(line)
            if m:
                dropped += int(m.group(2)) - int(m.group(1))
    return dropped


def read_run(fig: RunFigures, *, steps: int, pool: int) -> RunFigures:
    db_path = fig.run_dir / "monitor.db"
    if not db_path.exists():
        fig.error = "no monitor database"
        return fig
    db = MonitorReader(db_path)
    try:
        training = db.latest_training()
        if training is None:
            fig.error = "no training recorded"
            return fig
        fig.status = training["status"]
        rows = db.steps(training["id"])
        done = [r for r in rows if r["status"] == "completed" and r["step"] <= steps]
        fig.steps = len(done)
        if not done:
            fig.error = "no step completed"
            return fig
        first = db.first_rollout_start(training["id"])
        t0, t1 = _t(first or rows[0]["start_time"]), _t(done[-1]["end_time"])
        fig.phase_s = t1 - t0
        fig.pool = pool
        for r in done:
            m = json.loads(r["metrics_json"] or "{}")
            fig.trained += int(m.get("ppo_actor/n_seqs", 0))
            fig.wait_s += float(m.get("timeperf/rollout", 0.0))
            fig.train_s += sum(float(m.get(k, 0.0)) for k in TRAIN_KEYS)
            if "rollout/cua/accepted" in m:
                acc = float(m["rollout/cua/accepted"])
                fig.accepted_min = acc if fig.accepted_min is None else min(fig.accepted_min, acc)
            for k, v in m.items():
                if k.startswith("rollout/cua/rejected/"):
                    fig.rejected_stats.setdefault(k, []).append(round(float(v), 3))
        paused = [
            float(m["rollout/cua/gateway/paused_s"])
            for m in (json.loads(r["metrics_json"] or "{}") for r in done)
            if "rollout/cua/gateway/paused_s" in m
        ]
        fig.paused_s = sum(paused) / len(paused) if paused else 0.0

        rollouts = db.training_rollouts_with_environment(training["id"])
        turns: dict[int, list[tuple[float, float]]] = {}
        timed = 0
        for turn in db.training_turn_times(training["id"]):
            rid, start, end = turn["rollout_id"], turn["start_time"], turn["end_time"]
            a, b = _t(start), _t(end)
            if a is not None and b is not None and b > a:
                turns.setdefault(rid, []).append((a, b))
                timed += 1
        if rollouts and not timed:
            fig.error = "turn rows carry no step times (needs the recorder's step times)"
        for r in rollouts:
            ended = _t(r["end_time"])
            if r["status"] == "completed" and ended is not None and ended <= t1:
                fig.finished += 1
            elif r["status"] == "failed":
                reason = r["error_message"] or "unknown"
                fig.rejected[reason] = fig.rejected.get(reason, 0) + 1
            elif r["status"] == "cancelled":
                fig.cancelled += 1
            born, died = _t(r["creation_time"]), _t(r["termination_time"])
            if born is None:
                continue
            steps_of_box = turns.get(r["id"], [])
            # The pool's view: whatever part of the box's life and work fell inside the phase.
            fig.pool_held_s += union_seconds([(born, died or t1)], t0, t1)
            worked = union_seconds(steps_of_box, t0, t1)
            fig.pool_busy_s += worked
            fig.pool_boxes += worked > 0
            if died is not None and died <= t1:
                fig.boxes += 1
                fig.lifetime_s += died - born
                fig.busy_s += union_seconds(steps_of_box, born, died)
    finally:
        db.close()
    fig.dropped = dropped_from_log(fig.run_dir)
    return fig


# ---------------------------------------------------------------------------- running


def run_dir_of(runs_dir: Path, mode: str, k: int) -> Path:
    return runs_dir / (f"offpolicy-{k}" if mode == "service" else f"{mode}-offpolicy-{k}")


def train_once(args: argparse.Namespace, mode: str, k: int, runs_dir: Path) -> RunFigures:
    run_dir = run_dir_of(runs_dir, mode, k)
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "cua_rl.app.demo",
        "--run-dir",
        str(run_dir),
        "--model",
        args.model,
        "--box-startup",
        str(args.box_startup),
        "--step-latency",
        str(args.step_latency),
        "--agent-mode",
        mode,
        f"rollout.max_head_offpolicyness={k}",
        f"rollout.max_concurrent_rollouts={args.concurrency}",
        f"total_train_epochs={args.steps}",
        f"total_train_steps={args.steps}",
        f"agent.max_steps={args.agent_steps}",
        # The baseline warms vLLM up before the phase; an eval would sit inside it.
        "evaluator.eval_before_train=true",
        "evaluator.freq_steps=null",
        "endpoint.mode=gateway",
        *args.overrides,
    ]
    print(
        f"[bench] agent {mode}, max_head_offpolicyness={k}: training {args.steps} steps ...",
        flush=True,
    )
    t0 = time.monotonic()
    with open(run_dir / "bench.log", "wb") as out:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    fig = RunFigures(k, run_dir, rc, time.monotonic() - t0, mode)
    pool = args.concurrency * args.group_size
    read_run(fig, steps=args.steps, pool=pool)
    shown = run_dir.relative_to(ROOT) if run_dir.is_relative_to(ROOT) else run_dir
    print(
        f"[bench]   exit {rc} in {fig.wall_s:.0f}s, training {fig.status}; {shown}/bench.log",
        flush=True,
    )
    return fig


# ---------------------------------------------------------------------------- report


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and b == b and a == a else "n/a"


def _versus(f: RunFigures, base: RunFigures) -> str:
    """One run's figures over another's, as ratios."""
    return (
        f"ep/min {_ratio(f.per_min(f.finished), base.per_min(base.finished))}, "
        f"trained/min {_ratio(f.per_min(f.trained), base.per_min(base.trained))}, "
        f"occupancy {_ratio(f.occupancy, base.occupancy)}, "
        f"box util {_ratio(f.box_util, base.box_util)} "
        f"({_ratio(f.box_util_net, base.box_util_net)} net of pauses), "
        f"pool util {_ratio(f.pool_util, base.pool_util)} "
        f"({_ratio(f.pool_util_net, base.pool_util_net)} net of pauses), "
        f"episodes lost {f.lost} vs {base.lost}"
    )


def _table(figs: list[RunFigures], args: argparse.Namespace) -> list[str]:
    head = (
        f"{'agent':>7} {'offpol':>6} {'phase s':>7} {'finished':>8} {'ep/min':>6} {'trained':>7} "
        f"{'tr/min':>6} {'box s':>5} {'box util':>8} {'occupancy':>9} {'pool util':>9} "
        f"{'paused':>6} {'rejected':>8} {'dropped':>7} {'cancel':>6} {'acc min':>7} "
        f"{'wait s':>6} {'train s':>7}"
    )
    out = [head, "-" * len(head)]
    for f in figs:
        if f.error or f.steps < args.steps:
            why = f.error or f"{f.steps} of {args.steps} steps completed"
            out.append(
                f"{f.mode:>7} {f.offpolicyness:>6} failed (exit {f.rc}, training {f.status}): {why}"
            )
            continue
        acc = "-" if f.accepted_min is None else f"{f.accepted_min:.2f}"
        out.append(
            f"{f.mode:>7} {f.offpolicyness:>6} {f.phase_s:>7.1f} {f.finished:>8} "
            f"{f.per_min(f.finished):>6.1f} "
            f"{f.trained:>7} {f.per_min(f.trained):>6.1f} {f.box_s:>5.1f} {f.box_util:>8.1%} "
            f"{f.occupancy:>9.1%} {f.pool_util:>9.1%} {f.paused_s:>5.2f}s "
            f"{sum(f.rejected.values()):>8} {f.dropped:>7} {f.cancelled:>6} {acc:>7} "
            f"{f.wait_s:>6.1f} {f.train_s:>7.1f}"
        )
    for f in figs:
        if f.rejected:
            out.append(f"  {f.mode} offpol {f.offpolicyness} rejected by reason: {f.rejected}")
        if f.rejected_stats:
            out.append(
                f"  {f.mode} offpol {f.offpolicyness} AReaL rejected stats per step: "
                f"{f.rejected_stats}"
            )
    return out


def report(figs: list[RunFigures], args: argparse.Namespace) -> list[str]:
    out = [
        "",
        f"async rollouts through the gateway: {args.steps} steps x "
        f"{args.batch_size} tasks x {args.group_size} samples, box start-up "
        f"{args.box_startup:g}s, step latency {args.step_latency:g}s, agent.max_steps "
        f"{args.agent_steps}, pool {args.concurrency * args.group_size} boxes "
        f"(max_concurrent_rollouts {args.concurrency}), model {args.model}",
        "",
        *_table(figs, args),
    ]
    good = {(f.mode, f.offpolicyness): f for f in figs if not f.error and f.steps >= args.steps}
    out.append("")
    for (mode, k), f in sorted(good.items()):
        other = good.get(("service", k))
        if mode != "service" and other is not None:
            out.append(f"{mode} / service at offpol {k}: {_versus(f, other)}")
    modes = sorted({m for m, _ in good}, key=lambda m: m != "service")
    sync = next((good[(m, 0)] for m in modes if (m, 0) in good), None)
    if sync is None:
        out.append("no synchronous run (max_head_offpolicyness=0) to compare with")
        return out
    for (mode, k), f in sorted(good.items()):
        if k != 0 and (mode, 0) in good:
            out.append(f"{mode} offpol {k} / offpol 0: {_versus(f, good[(mode, 0)])}")
    same = [f for (m, _), f in good.items() if m == sync.mode]
    best = max(same, key=lambda f: f.pool_util_net)
    out += [
        "",
        f"DART reports {DART_ENV_UTILISATION}x environment utilisation from decoupling. Here the "
        f"best ({sync.mode}) is offpol {best.offpolicyness}: pool utilisation "
        f"{_ratio(best.pool_util, sync.pool_util)} "
        f"({_ratio(best.pool_util_net, sync.pool_util_net)} counting weight-update pauses as "
        f"idle). Pool utilisation is occupancy x box utilisation; decoupling raises occupancy "
        f"(slots hold boxes during updates and the batch's tail), and the synchronous run's "
        f"{sync.occupancy:.0%} caps that gain at {_ratio(1.0, sync.occupancy)} on this setup. "
        f"The synchronous trainer waited {sync.wait_s:.1f}s for batches and trained "
        f"{sync.train_s:.1f}s in its {sync.steps} steps.",
    ]
    return out


CAVEATS = """\
What this local setup can and cannot show:
- Decoupling can only fill the time a slot of the pool holds no box: at most 1 / occupancy of the
  synchronous run. That idle time is the trainer's update (a few seconds of a tiny model on CPU)
  and the wait for a batch's slowest group. DART's 5.5x comes from a cluster where an update
  takes minutes, episodes last dozens of steps, many environments wait on the slowest trajectory
  of a batch, and rollout and training run on separate GPUs, so its synchronous baseline leaves
  environments idle far more than this one can.
- Rollout and training share 2 CPU cores: during an update the vLLM CPU server (and the agent,
  gym, monitor) run slower, so async episodes last longer ("box s") and ep/min gains less than
  pool utilisation.
- Box lifetime includes start-up; agent-step time includes the model calls, and a call that
  meets a weight update waits in the gateway ("paused", per episode): the figures "net of
  pauses" count that wait as idle (estimated from the mean). A box waiting for its run to
  start, for evaluation or for terminate is idle.
- A few steps per run: the first step fills the pipeline and the last stops it, so the ratios
  understate a long run's steady state; "cancel" is the in-flight work the stop threw away.
- Beyond max_head_offpolicyness 1, more staleness helps only when the pool holds more than one
  batch (--concurrency above the batch size): with the default pool of one batch the runs for 1
  and 2 differ by noise."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python bench/async_rollouts.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=6, help="PPO steps per run")
    parser.add_argument(
        "--offpolicyness",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="rollout.max_head_offpolicyness values, one run each (0 is the synchronous baseline)",
    )
    parser.add_argument(
        "--agent-modes",
        nargs="+",
        choices=("service", "builtin"),
        default=["service"],
        help="agent.mode values, one run per offpolicyness each: service (the local agent "
        "service) and/or builtin (the rollout workers run the agent loop)",
    )
    parser.add_argument(
        "--box-startup", type=float, default=2.0, help="seconds the local gym takes to create a box"
    )
    parser.add_argument(
        "--step-latency", type=float, default=1.0, help="seconds the local agent waits after a step"
    )
    parser.add_argument(
        "--model",
        default="qwen2-vl-bpe",
        choices=("qwen2-vl-bpe", "qwen2-vl-byte"),
        help="tiny model",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=2,
        help="rollout.max_concurrent_rollouts (groups in flight): the pool is this x n_samples "
        "boxes; the default, one batch, lets the synchronous run fill the pool",
    )
    parser.add_argument("--agent-steps", type=int, default=3, help="agent.max_steps per episode")
    parser.add_argument(
        "--batch-size", type=int, default=2, help="train_dataset.batch_size (tasks per step)"
    )
    parser.add_argument(
        "--group-size", type=int, default=2, help="gconfig.n_samples (episodes per task)"
    )
    parser.add_argument("--runs-dir", default="", help="default runs/bench-async-<time>")
    parser.add_argument(
        "--reread",
        action="store_true",
        help="read the runs already under --runs-dir again instead of training (give the flags "
        "they were trained with)",
    )
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for train.py")
    args = parser.parse_args(argv)
    if args.reread and not args.runs_dir:
        parser.error("--reread needs --runs-dir")
    if args.steps < 2:
        parser.error("--steps must be >= 2: asynchrony needs a step to overlap with")
    if any(k < 0 for k in args.offpolicyness):
        parser.error("--offpolicyness values must be >= 0")
    if args.concurrency < 1 or args.batch_size < 1 or args.group_size < 1 or args.agent_steps < 1:
        parser.error("--concurrency, --batch-size, --group-size and --agent-steps must be >= 1")
    args.overrides = [
        f"train_dataset.batch_size={args.batch_size}",
        f"gconfig.n_samples={args.group_size}",
        *args.overrides,
    ]
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    runs_dir = (ROOT / (args.runs_dir or f"runs/bench-async-{stamp}")).resolve()
    t0 = time.monotonic()
    pool = args.concurrency * args.group_size
    if args.reread:
        figs = [
            read_run(
                RunFigures(k, run_dir_of(runs_dir, mode, k), 0, 0.0, mode),
                steps=args.steps,
                pool=pool,
            )
            for mode in args.agent_modes
            for k in args.offpolicyness
        ]
    else:
        figs = [
            train_once(args, mode, k, runs_dir)
            for mode in args.agent_modes
            for k in args.offpolicyness
        ]
    for line in report(figs, args):
        print(line)
    print()
    print(CAVEATS)
    done = "read" if args.reread else f"trained in {time.monotonic() - t0:.0f}s"
    print(f"\n[bench] {len(figs)} runs {done}; they are in {runs_dir}")
    return 0 if all(not f.error and f.steps >= args.steps for f in figs) else 1


if __name__ == "__main__":
    sys.exit(main())
