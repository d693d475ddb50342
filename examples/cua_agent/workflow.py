"""The example's workflow: ``CUAAgentWorkflow`` with its hooks spelled out.

One AReaL episode is one gym execution driven by one agent run, turned into training rows; the
episode's pipeline (``cua_rl.rollout.episode``) calls these hooks, one per stage, and the library's
workflow (``cua_rl.rollout.workflow``) holds their implementations. A project changes a stage by
subclassing and overriding its hook, one method in one file, then naming its class in the YAML::

    workflow: my_project.workflow.MyWorkflow

Each hook below only calls the library's implementation; its docstring says when it runs, what
it may change and what it must not. A hook that raises rejects the episode ``hook_<name>``
(counted; every episode rejected so for ``failfast.persist_s`` stops the training, naming the hook
and the exception).
"""

from __future__ import annotations

from collections.abc import Sequence

from cua_rl.agent.spec import RunResult, RunSpec
from cua_rl.clients.genv_answers import EvaluationResult
from cua_rl.reward import RewardOutcome
from cua_rl.rollout.episode import Box, CapturedCalls, EpisodeObserver, EpisodeTask
from cua_rl.rollout.runtime import EpisodeScope
from cua_rl.rollout.workflow import CUAAgentWorkflow as _LibraryWorkflow
from cua_rl.trajectory import ConversionResult

__all__ = ["CUAAgentWorkflow"]


class CUAAgentWorkflow(_LibraryWorkflow):
    """AReaL's ``RolloutWorkflow`` for GUI agents (``configs/*.yaml``: ``workflow:``)."""

    def build_run_spec(self, task: EpisodeTask, box: Box, model_base_url: str) -> RunSpec:
        """After the gym execution exists: the agent run to start (instruction, model options,
        step limits). The model URL is the episode's gateway URL; keep it, or the rows are lost."""
        return super().build_run_spec(task, box, model_base_url)

    async def run_agent(self, spec: RunSpec, task: EpisodeTask) -> RunResult:
        """The agent's run, to its end (``agent.mode``: the agent service, the built-in loop or
        your agent function). Every model call must go to ``spec.model_base_url``."""
        return await super().run_agent(spec, task)

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

    def observers(self, episode: EpisodeScope) -> Sequence[EpisodeObserver]:
        """Before the episode starts: who observes it (stats, service pauses, the monitor, the
        warehouse, replay), each an ``EpisodeObserver`` with one method per event kind
        (``cua_rl.rollout.episode``). What an observer raises is counted and never changes the
        episode."""
        return super().observers(episode)
