"""The live free-reward signal: rewarded training episodes in which no action changed the state.

Each episode that ends (cancelled ones aside) is judged with ``cua_rl.audit.state``: rewarded
(the verifier's score before shaping is positive, or it succeeded) while none of its actions
changed the device's state (the gym's ``changed`` per action) is *free reward*; rewarded while the
gym said nothing of its actions' effect is *unknown*: a gym that gives no state is said so, never
counted as changed or unchanged. Two records of it:

- the rollout's own, in the monitor (``state_effect``, ``free_reward``, ``free_reward_unknown``,
  kept in its extra fields): the dashboard counts a step's marked rollouts, its curve;
- AReaL's rollout stats (``cua/free_reward``, ``cua/free_reward_unknown``, ``cua/state_unknown``):
  AReaL averages them over the episodes that ended since the step before (its rollout
  controller keeps no count of them), so a step's value is their share; the trainer logs a
  warning line for a step with any, as does the demo's progress.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cua_rl.audit.state import UNCHANGED, UNKNOWN, rewarded, run_effect
from cua_rl.logs import get_logger
from cua_rl.rollout.episode import AgentRan, Ended, EpisodeObserver

log = get_logger(__name__)

FREE_REWARD = "rollout/cua/free_reward"
FREE_REWARD_UNKNOWN = "rollout/cua/free_reward_unknown"
STATE_UNKNOWN = "rollout/cua/state_unknown"


class FreeRewardObserver(EpisodeObserver):
    """The episode's free-reward scalars under the stats ``scope`` read at its start, and its
    marks on its rollout (``recorder``: returns the episode's ``RolloutRecorder``, which the
    monitor's observer opens when the episode starts). Listed before the monitor's observer, so
    its note is queued before the rollout is completed."""

    name = "free_reward"

    def __init__(self, scope: str, recorder: Callable[[], Any]):
        self.scope, self.recorder = scope, recorder
        self.effect = UNKNOWN
        self.ran = False

    async def agent_ran(self, event: AgentRan) -> None:
        self.effect, self.ran = run_effect(event.run.events), True

    async def ended(self, event: Ended) -> None:
        if event.outcome == "cancelled":
            return
        from areal.utils import stats_tracker

        scalars = episode_scalars(event, self.effect, self.ran)
        stats_tracker.get(self.scope).scalar(**scalars)
        await self.recorder().note(
            state_effect=self.effect if self.ran else None,
            free_reward=int(scalars["cua/free_reward"]),
            free_reward_unknown=int(scalars["cua/free_reward_unknown"]),
        )


def episode_scalars(ended, effect: str, ran: bool) -> dict[str, float]:
    """``cua/free_reward``, ``cua/free_reward_unknown``, ``cua/state_unknown`` of one episode."""
    reward = ended.reward if ended.accepted else None
    paid = reward is not None and rewarded(reward.base, reward.success)
    return {
        "cua/free_reward": float(paid and effect == UNCHANGED),
        "cua/free_reward_unknown": float(paid and effect == UNKNOWN),
        "cua/state_unknown": float(ran and effect == UNKNOWN),
    }


def step_share(stats: Mapping[str, float], key: str = FREE_REWARD) -> float | None:
    """The share of a step's episodes (those that ended since the step before) with ``key``."""
    value = stats.get(key)
    return float(value) if isinstance(value, int | float) else None


def warning_line(step: int, stats: Mapping[str, float]) -> str | None:
    """The step's warning when rewarded episodes changed nothing (None when none did)."""
    share = step_share(stats)
    if not share:
        return None
    return (
        f"warning: step {step}: {share:.0%} of the episodes that ended since the step before "
        "were rewarded though no action of theirs changed the state (free reward?): audit the "
        "tasks with python -m cua_rl.audit --config <this config> (docs/audit.md)"
    )


def log_step(step: int, stats: Mapping[str, float]) -> None:
    line = warning_line(step, stats)
    if line is not None:
        log.warning(line)
