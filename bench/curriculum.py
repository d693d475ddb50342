"""Uniform against UCB task selection, in simulation (no model, no services).

A population of tasks whose success probabilities resemble GUI task sets: 40% near 0, 20% near
1, the rest spread between. Each step draws a batch of tasks and runs a group of rollouts per
task (Bernoulli successes); a group whose rewards are all equal teaches nothing, and training on
a group whose rewards differ raises that task's success probability (its logit moves up by
``--lr``). Both arms get the same population, the same rollout budget and the same seeds:

- uniform: AReaL's default, a shuffled pass over the tasks per epoch;
- ucb: the real ``CurriculumSampler`` (cua_rl/curriculum), drawing each batch from the outcomes
  recorded up to the previous step, as in training.

Prints, for each learning speed ``--lr``, per arm the share of rollouts spent in zero-variance
groups and the mean success over all tasks after the budget, then UCB's waste as a fraction of
uniform's (goal: at most 0.5) and the success gain (goal: above 0). The faster the policy
learns, the sooner the budget solves the learnable tasks, after which every selector is left
with tasks near 0 or 1: the sweep shows where that happens.

    python bench/curriculum.py [--tasks 500] [--steps 100] [--batch 32] [--group 8] [--seeds 5]
                               [--lr 0.05 0.1 0.2 0.5]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cua_rl.curriculum.sampler import CurriculumSampler  # noqa: E402
from cua_rl.curriculum.selector import CurriculumConfig, Outcome  # noqa: E402


def population(n: int, rng: random.Random) -> list[float]:
    """Success probabilities: 40% near 0, 20% near 1, 40% spread."""
    out = []
    for i in range(n):
        u = i / n
        if u < 0.4:
            out.append(rng.uniform(0.0, 0.03))
        elif u < 0.6:
            out.append(rng.uniform(0.97, 1.0))
        else:
            out.append(rng.uniform(0.05, 0.95))
    rng.shuffle(out)
    return out


def logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


class RecordedOutcomes:
    """The warehouse of the simulation: what the monitor would hold."""

    def __init__(self) -> None:
        self.rows: list[Outcome] = []

    def fetch(self) -> list[Outcome]:
        return list(self.rows)


@dataclass
class Result:
    rollouts: int
    wasted: int
    final_success: float
    seconds: float
    # Share of tasks whose success probability ended within [0.1, 0.9].
    learnable_left: float

    @property
    def waste_share(self) -> float:
        return self.wasted / self.rollouts


def simulate(arm: str, args: argparse.Namespace, seed: int) -> Result:
    pop_rng = random.Random(f"population:{seed}")
    probs = population(args.tasks, pop_rng)
    theta = [logit(p) for p in probs]
    task_ids = [f"task-{i:04d}" for i in range(args.tasks)]
    # The same stream of rollout outcomes for both arms: rollout j of task i at its k-th visit.
    visits = [0] * args.tasks
    recorded = RecordedOutcomes()
    sampler = None
    order: list[int] = []
    if arm == "ucb":
        sampler = CurriculumSampler(
            task_ids,
            config=replace(args.curriculum, kind="ucb", log_decisions=False),
            source=recorded,
            batch_size=args.batch,
            group_size=args.group,
            seed=seed,
        )
    rollouts = wasted = 0
    t0 = time.perf_counter()
    epoch = 0
    for step in range(args.steps):
        if sampler is not None:
            batch = [sampler.next_index() for _ in range(args.batch)]
        else:
            if len(order) < args.batch:
                order = list(range(args.tasks))
                random.Random(f"uniform:{seed}:{epoch}").shuffle(order)
                epoch += 1
            batch, order = order[: args.batch], order[args.batch :]
        updates = []
        for i in batch:
            p = 1 / (1 + math.exp(-theta[i]))
            draw = random.Random(f"rollouts:{seed}:{i}:{visits[i]}")
            visits[i] += 1
            successes = sum(draw.random() < p for _ in range(args.group))
            rollouts += args.group
            if successes in (0, args.group):
                wasted += args.group
            else:
                updates.append(i)
            recorded.rows.append(Outcome(task_ids[i], step, args.group, successes))
        for i in updates:
            theta[i] += args.lr_value
    final_p = [1 / (1 + math.exp(-t)) for t in theta]
    left = sum(0.1 <= p <= 0.9 for p in final_p) / args.tasks
    return Result(rollouts, wasted, sum(final_p) / args.tasks, time.perf_counter() - t0, left)


def compare(args: argparse.Namespace) -> dict[str, tuple[float, float, float, float]]:
    """Per arm: zero-variance share of all rollouts, final mean success, seconds per step, share
    of tasks left learnable."""
    out = {}
    for arm in ("uniform", "ucb"):
        rs = [simulate(arm, args, seed) for seed in range(args.seeds)]
        waste = sum(r.wasted for r in rs) / sum(r.rollouts for r in rs)
        final = sum(r.final_success for r in rs) / len(rs)
        seconds = sum(r.seconds for r in rs) / len(rs) / args.steps
        left = sum(r.learnable_left for r in rs) / len(rs)
        out[arm] = (waste, final, seconds, left)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=500)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument(
        "--lr",
        type=float,
        nargs="+",
        default=[0.05, 0.1, 0.2, 0.5],
        help="logit gain per informative group; one comparison per value",
    )
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--exploration", type=float, default=CurriculumConfig.exploration)
    ap.add_argument("--floor", type=float, default=CurriculumConfig.floor)
    ap.add_argument("--decay", type=float, default=CurriculumConfig.decay)
    ap.add_argument("--prior", type=float, default=CurriculumConfig.prior_successes)
    args = ap.parse_args(argv)
    args.curriculum = CurriculumConfig(
        kind="ucb",
        exploration=args.exploration,
        floor=args.floor,
        decay=args.decay,
        prior_successes=args.prior,
        prior_failures=args.prior,
    )
    budget = args.steps * args.batch * args.group
    pops = [population(args.tasks, random.Random(f"population:{s}")) for s in range(args.seeds)]
    initial = sum(map(sum, pops)) / (args.seeds * args.tasks)
    print(
        f"tasks={args.tasks} steps={args.steps} batch={args.batch} group={args.group} "
        f"seeds={args.seeds}: {budget} rollouts per arm and seed; initial mean success "
        f"{initial:.3f}"
    )
    print(
        f"ucb: exploration={args.exploration} floor={args.floor} decay={args.decay} "
        f"prior={args.prior}"
    )
    print(
        f"{'lr':>5} | {'zero-variance share':^21} | {'final mean success':^21} | "
        f"{'waste ratio':>11} {'success gain':>12} | {'tasks in [0.1, 0.9] at the end':>30}"
    )
    print(
        f"{'':>5} | {'uniform':>10} {'ucb':>10} | {'uniform':>10} {'ucb':>10} | {'(<= 0.5)':>11} {'(> 0)':>12} | {'uniform':>14} {'ucb':>15}"
    )
    draw_ms = []
    for lr in args.lr:
        args.lr_value = lr
        r = compare(args)
        (wu, fu, _, lu), (wc, fc, sc, lc) = r["uniform"], r["ucb"]
        draw_ms.append(1000 * sc)
        print(
            f"{lr:>5} | {wu:>10.3f} {wc:>10.3f} | {fu:>10.3f} {fc:>10.3f} | "
            f"{wc / wu:>11.3f} {fc - fu:>+12.3f} | {lu:>14.3f} {lc:>15.3f}"
        )
    print(f"ucb_draw_ms_per_step {sum(draw_ms) / len(draw_ms):.2f} ({args.tasks} tasks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
