"""Replay: a recorded success takes the place of a failed episode in a group that failed entirely.

A group whose episodes all fail has no variance, so GRPO learns nothing from it. With
``replay.enabled`` the group filter (``cua_rl.rollout.groups``) asks ``choose`` whether a recorded
success of the same task may stand in for ``per_group`` of its failed episodes, and ``apply``
swaps their rows for the success's own recorded rows (ids, images, behaviour logprobs, per-token
versions: rebuilt from the stored episode by ``cua_rl.warehouse.rebuild_rows``). The trainer
treats them like any stale rollout: decoupled PPO weights each token by pi_proximal /
pi_behaviour from the recorded logprobs, and masks tokens whose ratio exceeds the configured
bound (``actor.rejection_sampling``). A success older than ``max_age_versions`` is not used, nor
one of another task.

``choose`` and ``apply`` are pure; the ``ReplayPool`` is the rollout worker's memory of its
recorded successes and of which task each episode ran, since the filter sees rows only; the
worker's runtime owns it (``cua_rl.rollout.runtime``). ``ReplayObserver`` fills it as the train
episodes end: each accepted episode's task, a success's rows rebuilt from their stored form (what
the warehouse keeps), and on a failure the recorded successes of ``replay.trainings`` read from
the monitor (once per task and policy version). A failed read or rebuild is counted
(``cua/replay/record_errors``, ``cua/replay/fetch_errors``), never raised. ``shuffle_rewards`` is the negative control: after replay the group's
episode rewards are permuted, so the credit lands on a random episode.
"""

from __future__ import annotations

import asyncio
import collections
import random
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cua_rl.core.fields import doc
from cua_rl.credit.observer import stored_steps
from cua_rl.errors import ConfigError, MonitorError
from cua_rl.logs import get_logger
from cua_rl.rollout.episode import Ended, EpisodeObserver
from cua_rl.warehouse.episode import StoredEpisode, StoredEpisodeError
from cua_rl.warehouse.rebuild import RebuildError, rebuild_rows, stored_from_rows

log = get_logger(__name__)


@dataclass
class ReplayConfig:
    """Replay of recorded successes into groups that failed entirely (docs/learning.md)."""

    enabled: bool = doc(False, "Replace failed episodes of an all-fail group by recorded successes")
    per_group: int = doc(1, "Recorded successes put into one all-fail group (each replaces one)")
    max_age_versions: int = doc(
        4,
        "A success whose oldest sampled token is more than this many policy versions behind the "
        "group's is not used",
    )
    trainings: list[str] = doc(
        help="Other trainings (monitor run names) whose recorded successes may be replayed, "
        "besides this one's; their successes come from the monitor's episode store",
        factory=list,
    )
    pool_per_task: int = doc(8, "Recorded successes a rollout worker keeps per task (newest)")
    shuffle_rewards: bool = doc(
        False,
        "Negative control: permute the episode rewards of each group that got a replayed "
        "episode, so the replayed success's credit goes to a random episode",
    )
    seed: int = doc(0, "Seed of the control's permutations")

    def __post_init__(self) -> None:
        if self.per_group < 1:
            raise ConfigError(
                f"replay.per_group={self.per_group} must be >= 1 (and below gconfig.n_samples); "
                "turn replay off with replay.enabled=false"
            )
        if self.max_age_versions < 0:
            raise ConfigError(
                f"replay.max_age_versions={self.max_age_versions} must be >= 0 (0: only "
                "successes sampled at the group's own policy version)"
            )
        if self.pool_per_task < self.per_group:
            raise ConfigError(
                f"replay.pool_per_task={self.pool_per_task} is below replay.per_group="
                f"{self.per_group}; keep at least as many successes per task as a group takes"
            )
        if any(not isinstance(t, str) or not t for t in self.trainings):
            raise ConfigError(f"replay.trainings={self.trainings!r} must be non-empty run names")

    def check_group_size(self, n_samples: int) -> None:
        if self.enabled and self.per_group >= n_samples:
            raise ConfigError(
                f"replay.per_group={self.per_group} must be below gconfig.n_samples={n_samples}: "
                "a group keeps at least one fresh episode"
            )


@dataclass(frozen=True)
class Recorded:
    """A recorded success and the rows it trained (``rebuild_rows`` of its stored episode)."""

    task_id: str
    episode_id: int
    training: str
    reward: float
    version_min: int
    version_max: int
    rows: tuple[dict[str, Any], ...] = field(repr=False, compare=False)
    rollout_uuid: str = ""  # its rollout in the monitor
    # Its steps for step credit (cua_rl.credit.steps.EpisodeSteps), when step credit is on.
    steps: Any = field(default=None, repr=False, compare=False)

    def age(self, version: int) -> int:
        """Policy versions between its oldest sampled token and ``version``."""
        return version - self.version_min


def recorded_of(
    stored: StoredEpisode, rows: Sequence[dict[str, Any]], steps: Any = None
) -> Recorded:
    """A stored success with the rows ``rebuild_rows`` made of it (and, with step credit, its
    steps)."""
    return Recorded(
        task_id=stored.task_id,
        episode_id=stored.episode_id,
        training=stored.training,
        reward=stored.reward,
        version_min=stored.version_min,
        version_max=stored.version_max,
        rows=tuple(rows),
        rollout_uuid=stored.rollout_uuid,
        steps=steps,
    )


@dataclass(frozen=True)
class Plan:
    """Which failed episodes (by position in the group) the recorded successes replace."""

    replace: tuple[int, ...]
    recorded: tuple[Recorded, ...]

    def __bool__(self) -> bool:
        return bool(self.replace)


NO_PLAN = Plan((), ())


def choose(
    task_id: str,
    rewards: Sequence[float],
    version: int,
    candidates: Sequence[Recorded],
    config: ReplayConfig,
    *,
    tol: float = 1e-6,
    trainings: Sequence[str] = (),
) -> Plan:
    """The replay plan of one complete group of ``task_id`` sampled at policy ``version``.

    Only a group whose episode rewards are all equal qualifies, and only with candidates of the
    same task, from ``trainings`` (empty: any), at most ``max_age_versions`` old, whose reward is
    above the group's (a success where all failed). The newest come first; the last episodes of
    the group are replaced, so the fresh ones in front keep their order.
    """
    if not config.enabled or not rewards:
        return NO_PLAN
    if max(rewards) - min(rewards) > tol:
        return NO_PLAN
    allowed = set(trainings)
    usable = [
        c
        for c in candidates
        if c.task_id == task_id
        and (not allowed or c.training in allowed)
        and 0 <= c.age(version) <= config.max_age_versions
        and c.reward > rewards[0] + tol
    ]
    usable.sort(key=lambda c: (c.version_max, c.version_min), reverse=True)
    n = min(config.per_group, len(usable), len(rewards) - 1)
    if n <= 0:
        return NO_PLAN
    return Plan(tuple(range(len(rewards) - n, len(rewards))), tuple(usable[:n]))


def apply(
    rows: Sequence[dict[str, Any]], episode_rows: Sequence[Sequence[int]], plan: Plan
) -> list[dict[str, Any]]:
    """The group's rows with each replaced episode's rows swapped for its recorded success's
    (appended where the replaced episode's rows were dropped: the group's order of episodes
    changes, which GRPO does not see)."""
    dropped = {i for e in plan.replace for i in episode_rows[e]}
    out = [r for i, r in enumerate(rows) if i not in dropped]
    for recorded in plan.recorded:
        out.extend(recorded.rows)
    return out


def shuffled(rewards: Sequence[float], rng: random.Random) -> list[float]:
    """The control's permutation of a group's episode rewards."""
    out = list(rewards)
    rng.shuffle(out)
    return out


class Seen(NamedTuple):
    """What the worker knows of an episode it ran."""

    task_id: str
    version: int
    rollout_uuid: str
    success: bool  # the gym's verdict


def monitor_notes(plan: Plan, seen: Sequence[Seen], version: int, training: str) -> list[dict]:
    """The ``rollouts`` records that show a replay in the monitor: each replaced episode's
    rollout says it was not trained and which success took its place; a success of this training
    says into which group version it was replayed. No new rollout is recorded for a replay."""
    notes = []
    for e, r in zip(plan.replace, plan.recorded, strict=True):
        notes.append(
            {
                "client_id": seen[e].rollout_uuid,
                "status_message": f"not trained: replaced by the replayed success {r.rollout_uuid}"
                f" ({r.age(version)} versions old, training {r.training})",
            }
        )
        if r.training == training and r.rollout_uuid:
            notes.append(
                {
                    "client_id": r.rollout_uuid,
                    "status_message": f"replayed into an all-fail group at version {version}",
                }
            )
    return notes


class ReplayPool:
    """One rollout worker's recorded successes per task, and the task and policy version of its
    recent episodes (the filter sees only rows and their episode ids)."""

    def __init__(self, per_task: int = 8, episodes_kept: int = 100_000):
        self._lock = threading.Lock()
        self._per_task = per_task
        self._successes: dict[str, collections.deque[Recorded]] = {}
        self._episodes: collections.OrderedDict[int, Seen] = collections.OrderedDict()
        self._episodes_kept = episodes_kept
        self._asked: dict[str, int] = {}

    def note(
        self,
        episode_id: int,
        task_id: str,
        version: int,
        rollout_uuid: str = "",
        *,
        success: bool = False,
    ) -> None:
        with self._lock:
            self._episodes[int(episode_id)] = Seen(task_id, int(version), rollout_uuid, success)
            while len(self._episodes) > self._episodes_kept:
                self._episodes.popitem(last=False)

    def episode(self, episode_id: int) -> Seen | None:
        with self._lock:
            return self._episodes.get(int(episode_id))

    def add(self, recorded: Recorded) -> None:
        with self._lock:
            kept = self._successes.setdefault(
                recorded.task_id, collections.deque(maxlen=self._per_task)
            )
            if all(r.episode_id != recorded.episode_id for r in kept):
                kept.append(recorded)

    def first_ask(self, task_id: str, version: int) -> bool:
        """True once per task and policy version: when to read other trainings' successes."""
        with self._lock:
            if self._asked.get(task_id) == version:
                return False
            self._asked[task_id] = version
            return True

    def candidates(self, task_id: str) -> list[Recorded]:
        with self._lock:
            return list(self._successes.get(task_id, ()))


class ReplayObserver(EpisodeObserver):
    """With ``replay.enabled``, in the train phase: the pool learns each accepted episode's task,
    keeps a success's rows and, after a failure, reads the recorded successes of
    ``replay.trainings`` (see the module docstring). ``processor``: ``() ->`` the model's
    processor (loaded on first use); ``monitor``: ``async () ->`` the loop's monitor client, or
    None; ``training``: this run's name (its own successes are stored under it)."""

    name = "replay"

    def __init__(
        self,
        pool: ReplayPool,
        config: ReplayConfig,
        *,
        training: str,
        phase: str,
        processor: Callable[[], Any],
        monitor: Callable[[], Awaitable[Any]],
        ledger: Any = None,
        step_credit: Any = None,
    ):
        self.pool, self.config, self.training, self.phase = pool, config, training, phase
        self.processor, self.monitor = processor, monitor
        # With step credit (a CreditLedger, its StepCreditConfig), a success keeps its steps
        # (cua_rl.credit): its own episodes' from the worker's ledger, other trainings' read from
        # the stored episode.
        self.ledger, self.step_credit = ledger, step_credit

    async def ended(self, event: Ended) -> None:
        if not event.accepted or not self.config.enabled or self.phase != "train":
            return
        task, success = event.task, bool(event.reward.success)
        self.pool.note(
            task.episode_id, task.task_id, task.version, task.rollout_uuid, success=success
        )
        if not success:
            if self.config.trainings and self.pool.first_ask(task.task_id, task.version):
                await self.fetch(task.task_id, task.version)
            return
        rows = event.rows
        try:
            stored = stored_from_rows(
                rows.rows,
                rows.row_images,
                task_id=task.task_id,
                rollout_uuid=task.rollout_uuid,
                training=self.training,
                success=True,
                images=rows.image_data,
                row_turns=rows.row_turns,
            )
            rebuilt = await asyncio.to_thread(rebuild_rows, stored, self.processor())
        except (RebuildError, StoredEpisodeError, KeyError) as exc:
            # The episode trains as it is; only its replay is lost, and counted.
            _replay_error("cua/replay/record_errors", task.task_id, exc)
            return
        steps = self.ledger.peek(task.episode_id) if self.ledger is not None else None
        self.pool.add(recorded_of(stored, rebuilt, steps))

    async def fetch(self, task_id: str, version: int) -> None:
        """The recorded successes of ``task_id`` in the trainings ``replay.trainings`` names, from
        the monitor's episode store, rebuilt into the pool."""
        cfg = self.config
        client = await self.monitor()
        if client is None:
            return
        # Only what choose() can take: versions within max_age_versions of this one, none
        # ahead of it (a training further on than this one would fill the pool with successes
        # it can never use, pushing out its own), and never below 0 (the monitor refuses it).
        try:
            found = await client.successes(
                task_id,
                cfg.trainings,
                max(version - cfg.max_age_versions, 0),
                cfg.pool_per_task,
                max_version=version,
            )
            for stored in found:
                rows = await asyncio.to_thread(rebuild_rows, stored, self.processor())
                steps = None
                if self.ledger is not None:
                    steps = await asyncio.to_thread(stored_steps, stored, rows, self.step_credit)
                self.pool.add(recorded_of(stored, rows, steps))
        except (MonitorError, RebuildError, StoredEpisodeError) as exc:
            _replay_error("cua/replay/fetch_errors", task_id, exc)


def _replay_error(key: str, task_id: str, exc: Exception) -> None:
    from areal import workflow_context
    from areal.utils import stats_tracker

    stats_tracker.get(workflow_context.stat_scope()).scalar(**{key: 1.0})
    log.warning("replay of %s: %s: %s", task_id, key, exc)
