"""Group filters for ``PPOTrainer.train(dynamic_filter_fn=...)``: episodes are the unit of credit.

AReaL runs the filter in the rollout worker on each finished group (the rows of the
``gconfig.n_samples`` episodes of one task, concatenated) and trains only accepted groups; for a
rejected one it draws another task. An episode gives one row per run of calls that extend one
another (an agent that re-renders its history gives one per call), so a group has a variable
number of rows. AReaL's own group normalisation (``actor.reward_norm`` at group level) slices
fixed chunks of ``n_samples`` rows and would mix groups: the config refuses it, and the filter
normalises here instead, where the group is whole and its episodes are known by the
``episode_id`` every row carries:

- a group is complete when it holds ``n_samples`` distinct episodes (rows do not count);
- its episode rewards (one per episode, however many rows) are centred and scaled as
  ``group_norm`` says, and every row of an episode gets that episode's value in ``rewards``, so
  with AReaL's GAE at discount 1 (no critic) each trained token's advantage is its episode's;
- a group whose episode rewards are all equal teaches nothing; ``complete_groups`` counts it,
  ``complete_varied_groups`` also drops it.

AReaL calls the filter (a function named by its dotted path) with the group alone, in the task
that called the group's ``arun_episode``; the workflow puts its runtime's ``GroupFilter`` in that
context first (``enter``), so the filter judges with the settings and the replay pool of the
training whose episodes made the rows, two trainings in one process included. Each group records
0/1 stats under the rollout scope, so the step's stats are shares:
``cua/group/accepted``, ``cua/group/rejected/incomplete``, ``cua/group/zero_variance`` (of
complete groups), ``cua/group/rejected/zero_variance`` (``complete_varied_groups`` only), and
``cua/group/rows_per_episode``.

With ``replay.enabled`` a complete group whose episodes all fail first gets recorded successes of
its task in place of some failed episodes (``cua_rl.warehouse.replay``), before the variance test
and the normalisation: ``cua/replay/all_fail`` (share of complete groups whose episodes all
failed, by the gym's verdict, before replay), ``cua/replay/rescued`` (share of those that got a replayed episode),
``cua/replay/episodes`` (replayed episodes per rescued group) and ``cua/replay/age`` (their age in
policy versions).

With ``step_credit.enabled`` an accepted group's rows also get each step's advantage on its
tokens (``step_advantages``, ``cua_rl.credit``): the steps of its episodes come from the worker's
``CreditLedger`` (fresh episodes) or from the replayed successes themselves, and the step
groups' shares and sizes are recorded as ``cua/credit/...``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any

from cua_rl.core.fields import doc
from cua_rl.credit import advantages as credit
from cua_rl.credit.config import StepCreditConfig
from cua_rl.credit.ledger import CreditLedger
from cua_rl.errors import ConfigError
from cua_rl.logs import get_logger
from cua_rl.warehouse import replay
from cua_rl.warehouse.replay import ReplayConfig

log = get_logger(__name__)

COMPLETE_GROUPS = "cua_rl.rollout.groups.complete_groups"
COMPLETE_VARIED_GROUPS = "cua_rl.rollout.groups.complete_varied_groups"
NORM_LEVELS = ("group", "none")


@dataclass
class GroupNormConfig:
    """GRPO's per-group normalisation of episode rewards (each episode counted once)."""

    mean_level: str = doc(
        "group", "group: subtract the mean reward of the group's episodes; none: do not centre"
    )
    std_level: str = doc(
        "group", "group: divide by the std of the group's episode rewards (+eps); none: do not"
    )
    mean_leave1out: bool = doc(False, "Centre each episode on the mean of the others (RLOO)")
    std_unbiased: bool = doc(True, "Unbiased (n-1) std, as AReaL's NormConfig by default")
    eps: float = doc(1e-5, "Added to the std before dividing")

    def __post_init__(self) -> None:
        for name in ("mean_level", "std_level"):
            if getattr(self, name) not in NORM_LEVELS:
                raise ConfigError(
                    f"group_norm.{name}={getattr(self, name)!r}; use group or none (batch-level "
                    "scaling of advantages is actor.adv_norm's)"
                )
        if self.eps < 0:
            raise ConfigError(f"group_norm.eps={self.eps} must be >= 0, e.g. 1e-5")


@dataclass
class GroupSettings:
    """What the filter needs; part of the train workflow's settings."""

    size: int = 1  # episodes per group: gconfig.n_samples
    zero_variance_tol: float = 1e-6  # rewards within this spread count as equal
    norm: GroupNormConfig = field(default_factory=GroupNormConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    training: str = ""  # this training's run name: its own successes may be replayed
    step_credit: StepCreditConfig = field(default_factory=StepCreditConfig)


def episode_rewards(traj: dict[str, Any]) -> tuple[list[int], list[float], list[list[int]]]:
    """(episode ids in row order, each episode's reward, each episode's row indices)."""
    if "episode_id" not in traj:
        raise ConfigError(
            "the group's rows carry no episode_id: the group filter needs rows built by "
            "cua_rl.trajectory (CUAAgentWorkflow or a subclass)"
        )
    ids = [int(x) for x in traj["episode_id"].reshape(-1).tolist()]
    rewards = traj["rewards"].detach().float().reshape(-1).tolist()
    order: list[int] = []
    rows: dict[int, list[int]] = {}
    for i, e in enumerate(ids):
        if e not in rows:
            order.append(e)
            rows[e] = []
        rows[e].append(i)
    per_episode = []
    for e in order:
        values = {rewards[i] for i in rows[e]}
        if len(values) != 1:
            raise ValueError(f"episode {e}'s rows carry different rewards: {sorted(values)}")
        per_episode.append(values.pop())
    return order, per_episode, [rows[e] for e in order]


def normalised(rewards: list[float], norm: GroupNormConfig) -> list[float]:
    """Each episode's advantage: its reward centred and scaled within the group."""
    import torch

    x = torch.tensor(rewards, dtype=torch.float64)
    n = x.numel()
    if norm.mean_level == "group":
        if norm.mean_leave1out:
            mean = (x.sum() - x) / (n - 1) if n > 1 else torch.zeros_like(x)
        else:
            mean = x.mean().expand_as(x)
    else:
        mean = torch.zeros_like(x)
    centred = x - mean
    if norm.std_level == "group":
        if n == 1 and norm.std_unbiased:
            std = torch.ones(())
        else:
            # AReaL measures the spread around the mean it subtracted (leave-one-out included).
            dev = ((x - mean) ** 2).sum()
            std = (dev / (n - 1 if norm.std_unbiased else n)).sqrt()
        return (centred / (std + norm.eps)).tolist()
    return centred.tolist()


def _record(**stats: float) -> None:
    from areal import workflow_context
    from areal.utils import stats_tracker

    stats_tracker.get(workflow_context.stat_scope()).scalar(**stats)


class GroupFilter:
    """The group filter of one rollout runtime: its settings, the replay pool it reads, and where
    replays are shown (``notes``: the running loop's monitor ``enqueue``, or None)."""

    def __init__(
        self,
        settings: GroupSettings,
        pool: replay.ReplayPool | None = None,
        notes: Callable[[], Callable[[str, dict], bool] | None] = lambda: None,
        ledger: CreditLedger | None = None,
    ):
        self.settings = settings
        self.pool = pool if pool is not None else replay.ReplayPool(settings.replay.pool_per_task)
        self.notes = notes
        self.ledger = (
            ledger if ledger is not None else CreditLedger(settings.step_credit.max_episodes)
        )
        self._rng: random.Random | None = None  # the negative control's, made on first use

    def complete_groups(self, traj: dict[str, Any]) -> bool:
        """Accept a group only when every episode returned its rows, and normalise its rewards
        per episode (zero-variance groups are counted, not dropped)."""
        return self.judge(traj, drop_zero_variance=False)

    def complete_varied_groups(self, traj: dict[str, Any]) -> bool:
        """``complete_groups``, and also drop groups whose episode rewards are all equal."""
        return self.judge(traj, drop_zero_variance=True)

    def judge(self, traj: dict[str, Any], *, drop_zero_variance: bool) -> bool:
        import torch

        settings = self.settings
        episodes, rewards, rows = episode_rewards(traj)
        stats = {
            "cua/group/rejected/incomplete": 0.0,
            "cua/group/rows_per_episode": traj["rewards"].numel() / max(len(episodes), 1),
        }
        if drop_zero_variance:
            stats["cua/group/rejected/zero_variance"] = 0.0
        accepted = True
        plan = replay.NO_PLAN
        if len(episodes) != settings.size:
            log.warning(
                "group rejected: %d of %d episodes returned rows", len(episodes), settings.size
            )
            stats["cua/group/rejected/incomplete"] = 1.0
            accepted = False
        else:
            if settings.replay.enabled:
                traj, episodes, rewards, rows, plan = self._replay(
                    traj, episodes, rewards, rows, stats
                )
            zero_variance = max(rewards) - min(rewards) <= settings.zero_variance_tol
            stats["cua/group/zero_variance"] = float(zero_variance)
            if zero_variance and drop_zero_variance:
                stats["cua/group/rejected/zero_variance"] = 1.0
                accepted = False
        if accepted:
            out = torch.empty_like(traj["rewards"])
            for adv, idx in zip(normalised(rewards, settings.norm), rows, strict=True):
                out[idx] = adv
            traj["rewards"] = out
            if settings.step_credit.enabled:
                self._step_credit(traj, episodes, rewards, rows, plan, stats)
        stats["cua/group/accepted"] = float(accepted)
        _record(**stats)
        return accepted

    def _replay(self, traj, episodes, rewards, rows, stats: dict):
        """Put recorded successes into an all-fail group (in place in ``traj``); the group's
        episodes, rewards and row indices after it."""
        from cua_rl.trajectory.rows import stack_rows, unstack_rows

        settings, pool = self.settings, self.pool
        cfg, tol = settings.replay, settings.zero_variance_tol
        known = [pool.episode(e) for e in episodes]
        unchanged = traj, episodes, rewards, rows, replay.NO_PLAN
        if max(rewards) - min(rewards) > tol:
            stats["cua/replay/all_fail"] = 0.0
            return unchanged
        if any(k is None for k in known) or len({k.task_id for k in known}) != 1:
            # Rows of episodes this worker did not run (or of two tasks): never guess the task.
            stats["cua/replay/unknown_task"] = 1.0
            return unchanged
        # Equal rewards: all failed, or all succeeded (nothing to replay then).
        all_fail = not any(k.success for k in known)
        stats["cua/replay/all_fail"] = float(all_fail)
        if not all_fail:
            return unchanged
        task_id, version = known[0].task_id, max(k.version for k in known)
        trainings = [settings.training, *cfg.trainings]
        plan = replay.choose(
            task_id, rewards, version, pool.candidates(task_id), cfg, tol=tol, trainings=trainings
        )
        stats["cua/replay/rescued"] = float(bool(plan))
        if not plan:
            return unchanged
        if (enqueue := self.notes()) is not None:
            for note in replay.monitor_notes(plan, known, version, settings.training):
                enqueue("rollouts", note)
        new = stack_rows(replay.apply(unstack_rows(traj), rows, plan))
        traj.clear()
        traj.update(new)
        episodes, rewards, rows = episode_rewards(traj)
        if cfg.shuffle_rewards:
            if self._rng is None:
                self._rng = random.Random(cfg.seed)
            rewards = replay.shuffled(rewards, self._rng)
        stats["cua/replay/episodes"] = float(len(plan.recorded))
        stats["cua/replay/age"] = sum(r.age(version) for r in plan.recorded) / len(plan.recorded)
        log.info(
            "replay: group of %s (all %d failed) got recorded success(es) %s, age %s",
            task_id,
            len(rewards),
            [r.episode_id for r in plan.recorded],
            [r.age(version) for r in plan.recorded],
        )
        return traj, episodes, rewards, rows, plan

    def _step_credit(self, traj, episodes, rewards, rows, plan: replay.Plan, stats: dict) -> None:
        """Each step's advantage on its tokens (``step_advantages``): the fresh episodes' steps
        from the ledger, the replayed successes' from themselves; the group's step statistics
        into ``stats``, each fresh turn's credit to the monitor."""
        cfg = self.settings.step_credit
        recorded = {r.episode_id: r.steps for r in plan.recorded}
        steps = [recorded[e] if e in recorded else self.ledger.take(e) for e in episodes]
        result = credit.step_credit(steps, rewards, cfg)
        shape = tuple(traj["loss_mask"].shape)
        traj[credit.STEP_ADVANTAGES] = credit.token_advantages(
            shape, rows, steps, result, cfg.weight
        )
        stats.update(result.stats)
        if (enqueue := self.notes()) is not None:
            # A replayed success is not a rollout of this step: its monitor record stays as is.
            fresh = [None if e in recorded else s for e, s in zip(episodes, steps, strict=True)]
            for note in credit.turn_notes(fresh, result, cfg.weight):
                enqueue("turns", note)


# The filter of the group whose episodes run in this context (set by ``enter``).
_FILTER: ContextVar[GroupFilter | None] = ContextVar("cua_rl_group_filter", default=None)


def enter(group_filter: GroupFilter) -> Token:
    """Make ``group_filter`` the one AReaL's call of the filter meets in this context: the
    workflow calls it synchronously in ``arun_episode``, in the task that calls the filter
    afterwards (``cua_rl.areal.support`` declares that AReaL does). ``leave`` with the token
    restores the context's previous filter."""
    return _FILTER.set(group_filter)


def leave(token: Token) -> None:
    _FILTER.reset(token)


def current() -> GroupFilter:
    found = _FILTER.get()
    if found is None:
        raise ConfigError(
            "the group filter found no runtime in the group's context: it runs after a "
            "CUAAgentWorkflow's arun_episode, which puts its runtime's filter there (a subclass "
            "that overrides arun_episode with a coroutine function hides it: override the "
            "hooks instead); elsewhere call a GroupFilter's own complete_groups"
        )
    return found


def complete_groups(traj: dict[str, Any]) -> bool:
    """AReaL's filter (``COMPLETE_GROUPS``): the context's ``GroupFilter.complete_groups``."""
    return current().complete_groups(traj)


def complete_varied_groups(traj: dict[str, Any]) -> bool:
    """AReaL's filter (``COMPLETE_VARIED_GROUPS``): ``complete_groups``, also dropping groups
    whose episode rewards are all equal."""
    return current().complete_varied_groups(traj)
