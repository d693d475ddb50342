"""The task selector: recorded outcomes -> per-task estimates -> the next batch of tasks.

Pure functions and plain data, no I/O. ``estimate_tasks`` folds outcome rows (one per task and
policy version, as the monitor aggregates them) into one ``TaskEstimate`` per task; older
outcomes of a task weigh ``decay`` less per policy version before its newest one, because
training on a task changes its success rate. ``select_batch`` scores each task UCB-style: the
probability that a group of its rollouts has rewards that differ (what GRPO learns from; high
when the estimated success rate is far from 0 and 1), plus a bonus for tasks seldom tried. An
untried task is expected to be like the average tried one. It draws distinct tasks: each slot
goes to the best remaining score, except a ``floor`` share of slots drawn uniformly, so no task
starves. The draw depends only on the estimates, the seed and the batch index, so a resumed run
repeats a batch exactly.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError

KINDS = ("uniform", "ucb")


@dataclass
class CurriculumConfig:
    """The ``curriculum`` section of the training config."""

    kind: str = doc(
        "uniform",
        (
            "uniform: AReaL's shuffled epochs (the default until measured better on "
            "real task sets); ucb: draw each batch's tasks from their recorded outcomes "
            "(docs/curriculum.md). ucb reads the outcomes from the Training Monitor."
        ),
    )
    exploration: float = doc(
        0.2,
        (
            "UCB bonus coefficient c in c*sqrt(ln(1+N)/(1+n)) (N: all recorded tries, "
            "n: the task's): larger tries seldom-tried tasks more often"
        ),
    )
    floor: float = doc(
        0.05,
        (
            "Share of each batch's slots drawn uniformly among the remaining tasks, so "
            "no task starves (0 disables; 1 is uniform sampling without replacement)"
        ),
    )
    decay: float = doc(
        0.9,
        (
            "Weight of an outcome per policy version it is older than the task's newest "
            "outcome (1: all count the same; smaller: the estimate follows the policy's "
            "latest tries of the task, which training on it changes)"
        ),
    )
    prior_successes: float = doc(1.0, "Beta prior: pseudo-successes of a task before any outcome")
    prior_failures: float = doc(1.0, "Beta prior: pseudo-failures of a task before any outcome")
    seed: int | None = doc(None, "Seed of the draws (empty: the training's seed)")
    drop_zero_variance: bool = doc(
        False,
        (
            "Also drop groups whose rewards are all equal (their GRPO advantages are "
            "zero), counted as rollout/cua/group/rejected/zero_variance. The trainer then "
            "draws more tasks until the batch is full."
        ),
    )
    zero_variance_tol: float = doc(
        1e-6, "Rewards of a group within this spread (max - min) count as equal"
    )
    fetch_timeout_s: float = doc(
        10.0,
        (
            "Timeout of one read of the outcomes from the monitor; on failure the "
            "last outcomes read are used (counted in curriculum/fetch_errors)"
        ),
    )
    skip_flagged: bool = doc(
        False,
        (
            "Leave out of the train and eval tasks those a verifier audit flagged (free reward, "
            "rejects its own success, flaky: python -m cua_rl.audit, docs/audit.md): read from "
            "audit_file, else the newest completed audit of gym.gym_id the monitor recorded"
        ),
    )
    audit_file: str = doc(
        "", "The audit's JSON report skip_flagged reads; empty: the monitor's newest audit"
    )
    log_decisions: bool = doc(
        True,
        (
            "Append every draw (the estimates it used and the tasks chosen) to "
            "curriculum.jsonl in the run's log folder"
        ),
    )

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"curriculum.kind={self.kind!r}; use one of {', '.join(KINDS)}")
        if not 0.0 <= self.floor <= 1.0:
            raise ConfigError(f"curriculum.floor={self.floor} must be within [0, 1]")
        if not 0.0 < self.decay <= 1.0:
            raise ConfigError(
                f"curriculum.decay={self.decay} must be within (0, 1] (1 keeps every outcome)"
            )
        if self.exploration < 0:
            raise ConfigError(f"curriculum.exploration={self.exploration} must be >= 0")
        if self.prior_successes <= 0 or self.prior_failures <= 0:
            raise ConfigError(
                "curriculum.prior_successes and prior_failures must be > 0 (a Beta prior; "
                "1 and 1 make an untried task's estimate 0.5)"
            )
        if self.zero_variance_tol < 0:
            raise ConfigError(f"curriculum.zero_variance_tol={self.zero_variance_tol} must be >= 0")
        if self.fetch_timeout_s <= 0:
            raise ConfigError(f"curriculum.fetch_timeout_s={self.fetch_timeout_s} must be > 0")


@dataclass(frozen=True)
class Outcome:
    """Recorded outcomes of one task under one policy version (a step's rollouts of it)."""

    task_id: str
    version: int
    n: int
    successes: float
    reward_sum: float = 0.0

    def __post_init__(self) -> None:
        if self.n < 0 or not 0 <= self.successes <= self.n:
            raise ValueError(
                f"outcome of {self.task_id!r} at version {self.version}: "
                f"{self.successes} successes of {self.n} tries"
            )


@dataclass(frozen=True)
class TaskEstimate:
    """What the recorded outcomes say about one task."""

    tries: int = 0
    successes: float = 0.0
    # Tries and successes discounted by age (decay ** versions behind the newest outcome).
    weight: float = 0.0
    weighted_successes: float = 0.0

    def success(self, prior_successes: float = 1.0, prior_failures: float = 1.0) -> float:
        """Posterior mean success rate (Beta prior)."""
        return (self.weighted_successes + prior_successes) / (
            self.weight + prior_successes + prior_failures
        )


def estimate_tasks(
    task_ids: Sequence[str], outcomes: Iterable[Outcome], *, decay: float
) -> list[TaskEstimate]:
    """One estimate per task of ``task_ids`` (same order); outcomes of other tasks are ignored."""
    index = {t: i for i, t in enumerate(task_ids)}
    rows = [(index[o.task_id], o) for o in outcomes if o.task_id in index and o.n > 0]
    latest = [0] * len(task_ids)
    for i, o in rows:
        latest[i] = max(latest[i], o.version)
    acc = [[0, 0.0, 0.0, 0.0] for _ in task_ids]
    for i, o in rows:
        w = decay ** max(latest[i] - o.version, 0)
        a = acc[i]
        a[0] += o.n
        a[1] += o.successes
        a[2] += w * o.n
        a[3] += w * o.successes
    return [TaskEstimate(int(a[0]), a[1], a[2], a[3]) for a in acc]


def informative_probability(p: float, group_size: int) -> float:
    """Probability that a group of ``group_size`` rollouts with success rate ``p`` has both a
    success and a failure, i.e. rewards that differ and a non-zero GRPO advantage."""
    if group_size < 2:
        return p * (1.0 - p)
    return 1.0 - p**group_size - (1.0 - p) ** group_size


def scores(
    estimates: Sequence[TaskEstimate], *, group_size: int, config: CurriculumConfig
) -> list[float]:
    """UCB score of each task: expected learning signal plus a bonus for seldom-tried tasks."""
    log_total = math.log1p(sum(e.tries for e in estimates))
    signal = [
        informative_probability(
            e.success(config.prior_successes, config.prior_failures), group_size
        )
        for e in estimates
    ]
    tried = [x for x, e in zip(signal, estimates, strict=True) if e.tries]
    # An untried task is expected to be like the tasks tried so far (on GUI task sets most
    # sit near 0 or 1), not maximally learnable; the bonus still brings it in.
    untried = sum(tried) / len(tried) if tried else 1.0
    out = []
    for x, e in zip(signal, estimates, strict=True):
        bonus = config.exploration * math.sqrt(log_total / (1.0 + e.tries))
        out.append((x if e.tries else untried) + bonus)
    return out


@dataclass(frozen=True)
class Selection:
    """One batch: dataset indices in draw order, and how each slot was chosen."""

    indices: tuple[int, ...]
    by: tuple[str, ...]  # "ucb" or "floor", per slot


def draw_rng(seed: int, batch_index: int) -> random.Random:
    # A string seed hashes the same in every process and Python run (unlike hash()).
    return random.Random(f"cua-curriculum:{seed}:{batch_index}")


def select_batch(
    estimates: Sequence[TaskEstimate],
    batch_size: int,
    *,
    group_size: int,
    config: CurriculumConfig,
    seed: int,
    batch_index: int,
) -> Selection:
    """Draw ``batch_size`` distinct tasks. Deterministic in (estimates, seed, batch_index)."""
    n = len(estimates)
    if not 1 <= batch_size <= n:
        raise ConfigError(
            f"a batch of {batch_size} distinct tasks cannot be drawn from {n} train tasks; "
            "lower train_dataset.batch_size or select more tasks"
        )
    rng = draw_rng(seed, batch_index)
    score = scores(estimates, group_size=group_size, config=config)
    # Ties (e.g. every task untried) are broken at random, not by dataset order.
    tiebreak = [rng.random() for _ in range(n)]
    ranked = sorted(range(n), key=lambda i: (-score[i], tiebreak[i]))
    taken: set[int] = set()
    remaining = list(range(n))
    indices: list[int] = []
    by: list[str] = []
    cursor = 0
    for _ in range(batch_size):
        if config.floor > 0 and rng.random() < config.floor:
            i = remaining[rng.randrange(len(remaining))]
            how = "floor"
        else:
            while ranked[cursor] in taken:
                cursor += 1
            i = ranked[cursor]
            how = "ucb"
        taken.add(i)
        remaining.remove(i)
        indices.append(i)
        by.append(how)
    return Selection(tuple(indices), tuple(by))
