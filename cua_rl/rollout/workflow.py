"""``CUAAgentWorkflow``: AReaL's rollout workflow for GUI agents, one episode per ``arun_episode``.

The workflow is the adapter between AReaL and an episode, and it holds the episode's hooks: the
stages a project changes, which the pipeline (``cua_rl.rollout.episode``) calls directly, with
their implementations here:

- ``build_run_spec(task, box, model_base_url)``: the agent run to start;
- ``run_agent(spec, task)``: the run, to its end (the agent service, the built-in loop or the
  user's agent function, as ``agent.mode`` says: the runtime's);
- ``compute_reward(evaluation, calls)``: the gym's verdict -> the reward (``cua_rl.reward``);
- ``build_rows(task, calls, reward)``: the captured calls -> the training rows
  (``cua_rl.trajectory``);
- ``observers(episode)``: who observes the episode (``cua_rl.rollout.observers``).

A subclass overrides one method to change one stage, and is named in the config (``workflow:``;
examples/cua_agent/README.md). A hook that raises rejects the episode ``hook_<name>`` (counted,
and a systematic one stops the training through failfast); the workflow holds no state of its
own. AReaL hands ``arun_episode`` its worker's engine and a task; the workflow takes the worker's
runtime (``cua_rl.rollout.runtime``: one per engine), waits while a service is paused, and runs
the pipeline with the episode's observers inside the drain that closes it if the run ends first.
Infrastructure failures return ``None`` with a counted reason; a task the agent failed is rows
with reward 0.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any

from areal import workflow_context
from areal.api.workflow_api import RolloutWorkflow

from cua_rl import reward as rewards
from cua_rl.agent.spec import RunResult, RunSpec
from cua_rl.clients.genv_answers import EvaluationResult
from cua_rl.core.images import fetch_images
from cua_rl.core.reasons import hook_reason
from cua_rl.errors import ConfigError, RejectedEpisode
from cua_rl.heap import hold_mmap_threshold
from cua_rl.logs import get_logger
from cua_rl.rollout import episode as ep
from cua_rl.rollout import observers as obs
from cua_rl.rollout.groups import complete_groups  # noqa: F401  (an older dotted path)
from cua_rl.rollout.runtime import EpisodeScope, RolloutRuntime
from cua_rl.rollout.settings import WorkflowSettings
from cua_rl.trajectory.rows import ConversionResult, convert_turns, image_urls_needed

log = get_logger(__name__)


class CUAAgentWorkflow(RolloutWorkflow):
    """AReaL rollout workflow for GUI agents driven by gbox-mini-agent (or the local stand-in).

    ``runtime``: the rollout runtime to run episodes in (tests); by default the runtime of the
    engine of the first episode, built then (``RolloutRuntime.of``)."""

    def __init__(
        self,
        settings: WorkflowSettings,
        processor: Any = None,
        runtime: RolloutRuntime | None = None,
    ):
        if not isinstance(settings, WorkflowSettings):
            raise ConfigError(
                "CUAAgentWorkflow needs a WorkflowSettings (CUAConfig.workflow_settings()), got "
                f"{type(settings).__name__}"
            )
        self.settings = settings
        self._processor = processor
        self._runtime = runtime
        hold_mmap_threshold()  # screenshot buffers keep their own mappings (cua_rl/heap.py)

    @property
    def processor(self):
        if self._processor is None:
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self.settings.processor_path)
        return self._processor

    @property
    def runtime(self) -> RolloutRuntime:
        if self._runtime is None:
            raise ConfigError("this workflow has run no episode yet: it has no runtime")
        return self._runtime

    def runtime_for(self, engine: Any) -> RolloutRuntime:
        """The workflow's runtime: the one it was given, else its first engine's."""
        if self._runtime is None:
            self._runtime = RolloutRuntime.of(engine, self.settings)
        return self._runtime

    async def aclose(self) -> None:
        """Close the runtime this workflow ran in: its monitor flushed, its clients and gateway
        closed (tests; a worker's runtime ends with its process)."""
        if self._runtime is not None:
            await self._runtime.aclose()

    def model_name(self) -> str:
        return self.settings.endpoint.model_name or self.settings.processor_path

    # ------------------------------------------------------------------ hooks: the stages

    def build_run_spec(self, task: ep.EpisodeTask, box: ep.Box, model_base_url: str) -> RunSpec:
        """The agent run an episode asks for, once its box exists: the task's instruction, the
        agent's limits, and the sampling settings (through the gateway the trainer's win anyway)
        merged into the model object with the context policy and ``agent.model_options``. Keep
        ``model_base_url``, or the rows are lost."""
        s = self.settings
        options = {
            "temperature": s.sampling.temperature,
            "maxTokens": s.sampling.max_new_tokens,
            **s.agent.run_model_options(),
            **s.agent.model_options,
        }
        return RunSpec(
            task=task.instruction,
            model_base_url=model_base_url,
            model_name=self.model_name(),
            gym_base_url=s.gym.base_url,
            gym_id=s.gym.gym_id,
            execution_id=box.execution_id,
            agent=s.agent.agent,
            max_steps=s.agent.max_steps,
            max_run_time_s=s.agent.max_run_time_s,
            max_step_time_s=s.agent.max_step_time_s,
            provider=s.endpoint.provider,
            action_space=s.agent.action_space,
            model_options=options,
        )

    async def run_agent(self, spec: RunSpec, task: ep.EpisodeTask) -> RunResult:
        """The agent's run of ``spec``, to its end, as ``agent.mode`` says (the runtime's: the
        agent service, the built-in loop, or the user's agent function)."""
        return await self.runtime.run_agent(spec, task)

    def compute_reward(
        self, evaluation: EvaluationResult, calls: ep.CapturedCalls
    ) -> rewards.RewardOutcome:
        """The gym's verdict -> the reward (``cua_rl.reward``: the verdict's score, then
        ``reward.shaping``). Raises ``RejectedEpisode`` when the gym gave no verdict: an
        infrastructure failure is no reward 0."""
        facts = rewards.EpisodeFacts.from_turns(calls.turns)
        return rewards.compute_reward(evaluation.raw, facts, self.settings.reward)

    async def build_rows(
        self, task: ep.EpisodeTask, calls: ep.CapturedCalls, reward: rewards.RewardOutcome
    ) -> ConversionResult:
        """The captured calls -> the episode's rows, one per run of calls that extend one another
        (``cua_rl.trajectory``): from the gateway's capture, or in direct mode from the agent's
        events and the images they name (fetched from allowed hosts). Conversion runs in a thread
        so the event loop never blocks. A result with a reason and no rows rejects the episode."""
        config = self.settings.trajectory
        turns, fetched = calls.row_turns(), calls.images()
        if calls.capture is None:
            try:
                needed = image_urls_needed(turns, config)
                fetched = await fetch_images(needed, config, client=self.runtime.clients.http())
            except RejectedEpisode as exc:
                return ConversionResult(None, exc.reason, exc.detail, {"turns": len(turns)})
        return await asyncio.to_thread(
            convert_turns,
            turns,
            processor=self.processor,
            reward=reward.reward,
            version=task.version,
            config=config,
            fetched_images=fetched,
            episode_id=task.episode_id,
        )

    def observers(self, episode: EpisodeScope) -> Sequence[ep.EpisodeObserver]:
        """Who observes the episode (``cua_rl.rollout.observers.observers_of``: stats, service
        pauses, monitor, warehouse, replay), in the order each event reaches them. Override to
        add one: ``[*super().observers(episode), Mine(...)]``; what an observer raises is counted
        and never changes the episode."""
        return obs.observers_of(episode)

    # ------------------------------------------------------------------ the episode

    def arun_episode(self, engine, data: dict[str, Any]) -> Coroutine[Any, Any, Any]:
        """AReaL's entry: a coroutine AReaL awaits. Not a coroutine function: the runtime's group
        filter enters the caller's context here, the task in which AReaL then calls the filter
        (``cua_rl.rollout.groups``); the episode itself runs in the drain's records."""
        runtime = self.runtime_for(engine)
        runtime.enter_group()
        return runtime.drain.registered(lambda: self._episode(runtime, engine, data))

    async def _episode(self, runtime: RolloutRuntime, engine, data: dict[str, Any]):
        s = self.settings
        waited = await runtime.admit(s.phase)
        task = ep.EpisodeTask(dict(data), str(uuid.uuid4()), int(engine.get_version()))
        timings = ep.Timings(pause_wait_s=waited) if waited else ep.Timings()
        scope = runtime.episode(
            task,
            engine,
            is_eval=workflow_context.get().is_eval,
            stat_scope=workflow_context.stat_scope(),
            processor=lambda: self.processor,
            model_name=self.model_name(),
        )
        live = runtime.drain.live(task.rollout_uuid, surplus=scope.surplus)
        try:
            watching, refused = self.observers(scope), None
        except Exception as exc:  # the user's hook: the episode is told to the default list
            watching, refused = obs.observers_of(scope), exc
        emit = obs.Observers(
            [live, *watching], stat_scope=scope.stat_scope, first_time=scope.first_time
        )
        if refused is None:
            body = ep.run_episode(scope, self, emit, timings)
        else:
            body = self._refused(scope, emit, refused)
        return await runtime.drain.run(body, live, lambda: emit(ep.Ended(task, "cancelled")))

    async def _refused(self, scope: EpisodeScope, emit: obs.Observers, exc: Exception) -> None:
        """The episode whose ``observers`` hook raised: rejected ``hook_observers`` before it
        starts anything."""
        where = f"{type(self).__module__}.{type(self).__qualname__}.observers"
        if scope.first_time(("hook", where, type(exc))):
            log.error("%s raised %s:", where, type(exc).__name__, exc_info=exc)
        detail = f"{type(exc).__name__}: {exc} (raised by {where})"
        rejected = RejectedEpisode(hook_reason("observers"), detail)
        log.warning("episode %s rejected: %s", scope.task.rollout_uuid, rejected)
        await emit(ep.Started(scope.task))
        await emit(ep.Ended(scope.task, "rejected", rejected.reason, detail, rejected))
