"""The live free-reward signal: rewarded training episodes in which no action changed the state.

Each episode that ends (cancelled ones aside) adds, under AReaL's rollout stats scope, whether it
was rewarded (the verifier's score before shaping is positive, or it succeeded) while none of its
actions changed the device's state (``cua_rl.audit.state``: the gym's ``changed`` per action):
``cua/free_reward``. An episode rewarded while the gym said nothing about its actions' effect is
``cua/free_reward_unknown``, and any episode whose effect is unknown ``cua/state_unknown``: a gym
that gives no state is said so, never counted as changed or unchanged. AReaL averages scalars over
a step's episodes and keeps their number (``<key>__count``), so a step's count of free-reward
episodes is the mean times that number (``step_count``); the trainer logs a warning line for a
step that has any, the demo's progress line shows it, and the dashboard draws it per step.
"""

from __future__ import annotations

from collections.abc import Mapping

from cua_rl.audit.state import UNCHANGED, UNKNOWN, rewarded, run_effect
from cua_rl.logs import get_logger

log = get_logger(__name__)

FREE_REWARD = "rollout/cua/free_reward"
FREE_REWARD_UNKNOWN = "rollout/cua/free_reward_unknown"
STATE_UNKNOWN = "rollout/cua/state_unknown"


class FreeRewardObserver:
    """The episode's free-reward scalars, under the stats ``scope`` read at its start."""

    def __init__(self, scope: str):
        self.scope = scope
        self.effect = UNKNOWN
        self.ran = False

    async def on(self, event) -> None:
        # The pipeline's events, read by shape (``AgentRan`` carries the run, ``Ended`` its
        # outcome and reward), so this module does not import the rollout's episode.
        kind = type(event).__name__
        if kind == "AgentRan":
            self.effect, self.ran = run_effect(event.run.events), True
        elif kind == "Ended" and event.outcome != "cancelled":
            from areal.utils import stats_tracker

            stats_tracker.get(self.scope).scalar(**episode_scalars(event, self.effect, self.ran))


def episode_scalars(ended, effect: str, ran: bool) -> dict[str, float]:
    """``cua/free_reward``, ``cua/free_reward_unknown``, ``cua/state_unknown`` of one episode."""
    reward = ended.reward if ended.accepted else None
    paid = reward is not None and rewarded(reward.base, reward.success)
    return {
        "cua/free_reward": float(paid and effect == UNCHANGED),
        "cua/free_reward_unknown": float(paid and effect == UNKNOWN),
        "cua/state_unknown": float(ran and effect == UNKNOWN),
    }


def step_count(stats: Mapping[str, float], key: str = FREE_REWARD) -> int | None:
    """Episodes of a step's stats that had ``key`` (its mean times its number); None without."""
    mean, n = stats.get(key), stats.get(f"{key}__count")
    if not isinstance(mean, int | float) or not isinstance(n, int | float):
        return None
    return round(mean * n)


def warning_line(step: int, stats: Mapping[str, float]) -> str | None:
    """The step's warning when rewarded episodes changed nothing (None when none did)."""
    free = step_count(stats)
    if not free:
        return None
    n = step_count(stats, "rollout/cua/accepted") or 0
    return (
        f"warning: step {step}: {free} of {n} episodes were rewarded though no action of theirs "
        "changed the state (free reward?): audit the tasks with python -m cua_rl.audit "
        "--config <this config> (docs/audit.md)"
    )


def log_step(step: int, stats: Mapping[str, float]) -> None:
    line = warning_line(step, stats)
    if line is not None:
        log.warning(line)
