"""The example's workflow: ``CUAAgentWorkflow`` with its four hooks spelled out.

One AReaL episode is one gym execution driven by one agent run, turned into one training row;
the orchestration lives in ``cua_rl.rollout.workflow``. A project customises an episode by
subclassing and overriding these hooks, then naming its class in the YAML::

    workflow: my_project.workflow.MyWorkflow

Each hook below only calls the library's implementation; its docstring says when it runs, what
it may change and what it must not.
"""

from __future__ import annotations

from cua_rl.agent.spec import RunSpec
from cua_rl.monitor.worker.recorder import RolloutRecorder
from cua_rl.reward import RewardOutcome
from cua_rl.rollout.episode import Episode
from cua_rl.rollout.workflow import CUAAgentWorkflow as _LibraryWorkflow
from cua_rl.trajectory import ConversionResult

__all__ = ["CUAAgentWorkflow"]


class CUAAgentWorkflow(_LibraryWorkflow):
    """AReaL's ``RolloutWorkflow`` for GUI agents (``configs/*.yaml``: ``workflow:``)."""

    def build_run_spec(self, episode: Episode) -> RunSpec:
        """After the gym execution exists: the agent run to start (instruction, model options,
        step limits). The model URL is the episode's gateway URL; keep it, or the row is lost."""
        return super().build_run_spec(episode)

    def compute_reward(self, episode: Episode) -> RewardOutcome:
        """After the gym evaluated the execution: its answer -> the reward. Raise
        ``RejectedEpisode`` when there is no verdict (an infrastructure failure is no reward 0)."""
        return super().compute_reward(episode)

    async def build_row(self, episode: Episode) -> ConversionResult:
        """After the reward: one training row from the captured turns (exact ids, logprobs,
        versions, images). Return a result with a reason instead of a row to reject."""
        return await super().build_row(episode)

    async def record_episode(self, episode: Episode, recorder: RolloutRecorder) -> None:
        """Last: the monitor's records of the episode (turns, actions, screenshots). Never
        raises into training."""
        await super().record_episode(episode, recorder)
