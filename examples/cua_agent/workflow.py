"""The example's workflow: ``CUAAgentWorkflow`` with its four hooks spelled out.

One AReaL episode is one gym execution driven by one agent run, turned into training rows; the
episode's pipeline lives in ``cua_rl.rollout.episode``, the workflow that runs it in
``cua_rl.rollout.workflow``. A project customises an episode by subclassing and overriding these
hooks, then naming its class in the YAML::

    workflow: my_project.workflow.MyWorkflow

Each hook below only calls the library's implementation; its docstring says when it runs, what
it may change and what it must not.
"""

from __future__ import annotations

from cua_rl.agent.spec import RunSpec
from cua_rl.clients.genv_answers import EvaluationResult
from cua_rl.monitor.worker.recorder import RolloutRecorder
from cua_rl.reward import RewardOutcome
from cua_rl.rollout.episode import Box, CapturedCalls, EpisodeTask
from cua_rl.rollout.workflow import CUAAgentWorkflow as _LibraryWorkflow
from cua_rl.trajectory import ConversionResult

__all__ = ["CUAAgentWorkflow"]


class CUAAgentWorkflow(_LibraryWorkflow):
    """AReaL's ``RolloutWorkflow`` for GUI agents (``configs/*.yaml``: ``workflow:``)."""

    def build_run_spec(self, task: EpisodeTask, box: Box, model_base_url: str) -> RunSpec:
        """After the gym execution exists: the agent run to start (instruction, model options,
        step limits). The model URL is the episode's gateway URL; keep it, or the rows are lost."""
        return super().build_run_spec(task, box, model_base_url)

    def compute_reward(self, evaluation: EvaluationResult, calls: CapturedCalls) -> RewardOutcome:
        """After the gym evaluated the execution: its answer -> the reward. Raise
        ``RejectedEpisode`` when there is no verdict (an infrastructure failure is no reward 0)."""
        return super().compute_reward(evaluation, calls)

    async def build_rows(
        self, task: EpisodeTask, calls: CapturedCalls, reward: RewardOutcome
    ) -> ConversionResult:
        """After the reward: the training rows from the captured calls (exact ids, logprobs,
        versions, images), one per run of calls that extend one another. Return a result with a
        reason and no rows to reject."""
        return await super().build_rows(task, calls, reward)

    def observers(self, task: EpisodeTask, recorder: RolloutRecorder) -> list:
        """Before the episode starts: who observes it besides its stats and pauses (the monitor's
        records through ``recorder``, the warehouse, replay). Each gets every event
        (``cua_rl.rollout.episode``) and must never raise into training."""
        return super().observers(task, recorder)
