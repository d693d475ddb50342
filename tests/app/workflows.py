"""Workflow subclasses the extension-point tests run, importable by dotted path (AReaL's rollout
workers rebuild a config's ``workflow:`` class from it): each overrides one hook, as a user's
project does (examples/cua_agent/README.md, *Customising the workflow*)."""

from __future__ import annotations

from dataclasses import replace

from cua_rl.rollout.episode import EpisodeObserver
from cua_rl.rollout.workflow import CUAAgentWorkflow

# Far above any reward the gym's verdict and the shaping give (at most 1): a row that carries it
# was credited by the subclass's hook.
BONUS = 100.0


class RewardPlusBonus(CUAAgentWorkflow):
    """Overrides the reward alone: the library's, plus ``BONUS``."""

    def compute_reward(self, evaluation, calls):
        outcome = super().compute_reward(evaluation, calls)
        return replace(outcome, reward=outcome.reward + BONUS)


class BrokenReward(CUAAgentWorkflow):
    """A reward with a bug: it raises on every episode."""

    def compute_reward(self, evaluation, calls):
        raise ZeroDivisionError("the reward's bug")


class BrokenRunSpec(CUAAgentWorkflow):
    def build_run_spec(self, task, box, model_base_url):
        raise KeyError("instruction")


class BrokenAgent(CUAAgentWorkflow):
    async def run_agent(self, spec, task):
        raise RuntimeError("the agent's bug")


class BrokenRows(CUAAgentWorkflow):
    async def build_rows(self, task, calls, reward):
        raise ValueError("the row builder's bug")


class RewardOfTheWrongType(CUAAgentWorkflow):
    """A reward hook that returns a number where the pipeline takes a ``RewardOutcome``."""

    def compute_reward(self, evaluation, calls):
        return super().compute_reward(evaluation, calls).reward


class BrokenObservers(CUAAgentWorkflow):
    def observers(self, episode):
        raise AttributeError("the observer list's bug")


class Raising(EpisodeObserver):
    """An observer that raises at every event kind (``kinds``: those it saw)."""

    name = "raising"

    def __init__(self):
        self.kinds: list[str] = []

    async def on(self, event):
        self.kinds.append(event.kind)
        raise RuntimeError(f"the observer's bug at {event.kind}")


class WithRaisingObserver(CUAAgentWorkflow):
    """The library's observers after one that raises at every event: each is still told."""

    def __init__(self, settings, **kwargs):
        super().__init__(settings, **kwargs)
        self.raising = Raising()

    def observers(self, episode):
        return [self.raising, *super().observers(episode)]
