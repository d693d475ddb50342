"""``CUAAgentWorkflow``: AReaL's rollout workflow for GUI agents, one episode per ``arun_episode``.

The workflow is the adapter between AReaL and an episode; it orchestrates and holds no state of
its own. AReaL hands ``arun_episode`` its worker's engine and a task. The workflow takes the
worker's runtime (``cua_rl.rollout.runtime``: the gateway, the service clients, the pauses, the
drain, the replay pool and the group filter, one per engine), waits while a service is paused,
and runs the episode's pipeline (``cua_rl.rollout.episode``: box, agent run, captured calls,
evaluation, reward, rows) with its stages and observers (``cua_rl.rollout.observers``: stats,
service pauses, monitor, warehouse, replay), inside the drain that closes it if the run ends
first. Infrastructure failures return ``None`` with a counted reason; a task the agent failed is
rows with reward 0.

Users customise an episode by overriding the hooks (examples/cua_agent/README.md):
``build_run_spec``, ``compute_reward``, ``build_rows`` and ``observers``, and name their subclass
in the config (``workflow:``).
"""

from __future__ import annotations

import uuid
from collections.abc import Coroutine
from typing import Any

from areal import workflow_context
from areal.api.workflow_api import RolloutWorkflow

from cua_rl.credit.observer import CreditObserver
from cua_rl.errors import ConfigError
from cua_rl.heap import hold_mmap_threshold
from cua_rl.rollout import episode as ep
from cua_rl.rollout import observers as obs
from cua_rl.rollout.groups import complete_groups  # noqa: F401  (an older dotted path)
from cua_rl.rollout.runtime import RolloutRuntime
from cua_rl.rollout.settings import WorkflowSettings


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

    # ------------------------------------------------------------------ hooks

    def build_run_spec(self, task: ep.EpisodeTask, box: ep.Box, model_base_url: str):
        """The agent run request (a ``RunSpec``), once the box exists. Override to change the
        instruction or the model options; keep ``model_base_url``, or the rows are lost."""
        return ep.run_spec(task, box, model_base_url, self.settings, self.model_name())

    def compute_reward(self, evaluation, calls: ep.CapturedCalls):
        """Evaluation -> reward (a ``RewardOutcome``; raises ``RejectedEpisode`` when the gym gave
        no verdict: an infrastructure failure is no reward 0)."""
        return ep.reward_of(evaluation, calls, self.settings.reward)

    async def build_rows(self, task: ep.EpisodeTask, calls: ep.CapturedCalls, reward):
        """Calls -> the episode's rows (a ``ConversionResult``: one row per run of calls that
        extend one another); return a result with a reason and no rows to reject."""
        return await ep.rows_of(
            task,
            calls,
            reward,
            processor=self.processor,
            config=self.settings.trajectory,
            http=self.runtime.clients.http(),
        )

    def observers(self, task: ep.EpisodeTask, recorder) -> list:
        """Who observes the episode besides its stats and pauses: the monitor (through
        ``recorder``, a ``RolloutRecorder``), the warehouse and replay. Override to record more
        or less; each observer's ``async on(event)`` gets every event."""
        runtime, s = self.runtime, self.settings
        found = [
            obs.MonitorObserver(recorder, s.trajectory, runtime.clients.http()),
            obs.WarehouseObserver(recorder, s),
            obs.ReplayObserver(
                runtime.replay,
                s,
                lambda: self.processor,
                runtime.clients.monitor_client,
                runtime.groups.ledger,
            ),
        ]
        if s.group.step_credit.enabled and s.phase == "train":
            # Its rows (Converted) come before the end replay keeps a success at (Ended).
            found.insert(2, CreditObserver(runtime.groups.ledger, s.group.step_credit, task))
        return found

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
        context = workflow_context.get()
        recorder = await obs.recorder_for(runtime.clients, s, task, context.is_eval)
        live = runtime.drain.live(task.rollout_uuid)
        emit = obs.Observers(
            live,
            obs.StatsObserver(workflow_context.stat_scope(), s.phase, runtime.outcomes),
            obs.PauseObserver(runtime.pause_for, s.phase, lambda: engine.choose_server()),
            *self.observers(task, recorder),
        )
        stages = ep.EpisodeStages(
            open_endpoint=lambda t: runtime.open_endpoint(
                t.rollout_uuid,
                engine,
                processor=lambda: self.processor,
                model_name=self.model_name(),
            ),
            open_box=lambda t: runtime.clients.gym().execution(t.task_id),
            build_run_spec=self.build_run_spec,
            run_agent=lambda spec: runtime.run_agent(spec, task),
            compute_reward=self.compute_reward,
            build_rows=self.build_rows,
        )
        body = ep.run_episode(task, stages, emit, timings)
        return await runtime.drain.run(body, live, lambda: emit(ep.Ended(task, "cancelled")))
