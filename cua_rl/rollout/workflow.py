"""``CUAAgentWorkflow``: one AReaL episode = one gym execution driven by one agent run.

The workflow only orchestrates. Per episode it creates a gym execution (terminated on every exit,
cancellation included), opens the episode on its worker's rollout gateway (``cua_rl.gateway``:
the agent's model endpoint, which samples through the trainer's engine and captures exact
tokens, logprobs, versions and images), starts a gbox-mini-agent run pointed at it, waits for
it, evaluates the execution, computes the reward, and builds one training row from what the
gateway captured (``endpoint.mode=direct``: from the agent's own event log) with the pure
functions of ``cua_rl.trajectory``: one row per run of calls that extend one another, so every
call is trained whatever the agent keeps in its context; the group filter
(``cua_rl.rollout.groups``) then gives every row its episode's group-normalised reward. Infrastructure failures return ``None`` with a counted reason;
a task the agent failed is a row with reward 0. While the gym, the agent service or the model
server fails, new episodes wait at their start (``cua_rl.rollout.service_pauses``). When the run ends, the episodes still in flight
are cancelled and closed within ``drain.timeout_s`` (``cua_rl.rollout.drain``).

Users customise it by overriding the hooks: ``build_run_spec``, ``compute_reward``, ``build_row``
and ``record_episode`` (see the README), and name their subclass in the config (``workflow:``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from areal import workflow_context
from areal.api.workflow_api import RolloutWorkflow

from cua_rl.agent.builtin import run_builtin
from cua_rl.agent.service_driver import RunDriver
from cua_rl.agent.spec import RunResult, RunSpec
from cua_rl.core.reasons import AGENT_PREFIX, Reason, agent_reason
from cua_rl.errors import ConfigError, CuaRlError, GymError, MonitorError, RejectedEpisode
from cua_rl.gateway import AReaLEngineView, SessionSpec, gateway_for
from cua_rl.heap import hold_mmap_threshold, release_free_memory
from cua_rl.logs import get_logger
from cua_rl.monitor.worker.context import MonitorContext
from cua_rl.monitor.worker.recorder import RolloutRecorder
from cua_rl.monitor.worker.uploader import http_fetcher
from cua_rl.reward import EpisodeFacts, RewardOutcome, compute_reward
from cua_rl.rollout import groups
from cua_rl.rollout.drain import (
    DRAIN_REASON,
    drain_before_runner_stops,
    drained_episode,
    run_drained,
)
from cua_rl.rollout.episode import Episode, Phase, episode_stats, gateway_reason
from cua_rl.rollout.groups import complete_groups  # noqa: F401  (an older dotted path)
from cua_rl.rollout.outcomes import OutcomeLog
from cua_rl.rollout.placement import is_surplus, rollout_source
from cua_rl.rollout.service_pauses import (
    MODEL_SERVER,
    PauseRecords,
    Pauses,
    loop_pauses,
    outage_of,
    pause_for_held_calls,
    probe_for,
)
from cua_rl.rollout.services import Services
from cua_rl.rollout.settings import WorkflowSettings
from cua_rl.trajectory import (
    ConversionResult,
    convert_turns,
    events_to_turns,
    fetch_images,
    image_urls_needed,
)
from cua_rl.trajectory.row import episode_id_of
from cua_rl.warehouse import (
    RebuildError,
    StoredEpisodeError,
    rebuild_rows,
    replay,
    stored_from_rows,
)
from cua_rl.warehouse.rebuild import stored_episode_of

log = get_logger(__name__)


class CUAAgentWorkflow(RolloutWorkflow):
    """AReaL rollout workflow for GUI agents driven by gbox-mini-agent (or the local stand-in)."""

    def __init__(self, settings: WorkflowSettings, processor: Any = None):
        if not isinstance(settings, WorkflowSettings):
            raise ConfigError(
                "CUAAgentWorkflow needs a WorkflowSettings (CUAConfig.workflow_settings()), got "
                f"{type(settings).__name__}"
            )
        self.settings = settings
        self._outcomes = OutcomeLog(settings.outcome_dir) if settings.outcome_dir else None
        self._processor = processor
        self.services = Services.shared(settings)
        hold_mmap_threshold()  # screenshot buffers keep their own mappings (cua_rl/heap.py)
        if settings.phase == "train":
            # The group filter AReaL calls beside this workflow reads its settings from here.
            groups.configure(settings.group)
        drain_before_runner_stops()

    @property
    def processor(self):
        if self._processor is None:
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self.settings.processor_path)
        return self._processor

    async def aclose(self) -> None:
        """Flush the monitor and close HTTP clients (tests and train.py call this)."""
        await self.pauses().aclose()
        await self.services.aclose()

    def pauses(self) -> Pauses:
        """The running loop's service pauses, shared by the worker's workflows."""
        outcome = self._outcomes.record if self._outcomes else None
        return loop_pauses(
            self.settings.pause,
            lambda: PauseRecords(
                self.settings.training_ref, outcome, lambda: self.services.monitor
            ),
        )

    def pause_for(self, engine, episode: Episode, exc: RejectedEpisode) -> None:
        """Hold new episodes when ``exc`` is its service's failure, not the episode's."""
        run = episode.run.summary if episode.run else None
        created = episode.execution_id is not None
        outage = outage_of(
            exc, created=created, agent_unavailable=bool(run and run.create_unavailable)
        )
        if outage is None:
            return
        genv, agent, http = self.services.clients()
        server = self.settings.gateway.model_server_url
        if outage.service == MODEL_SERVER and not server:
            server = str(engine.choose_server())
        probe = probe_for(
            outage.service,
            self.settings.pause,
            genv=genv,
            agent=agent,
            http=http,
            task_id=episode.task_id,
            model_server=server,
        )
        self.pauses().report(outage, probe, phase=self.settings.phase)

    def open_model_endpoint(self, engine, episode: Episode) -> str:
        """The agent's OpenAI base URL: this episode's gateway URL, or (direct mode) the
        configured server or one of the engine's servers in turn."""
        s = self.settings
        if s.endpoint.mode == "gateway":
            spec = SessionSpec(
                AReaLEngineView(engine), s.sampling, self.processor, self.model_name(), s.trajectory
            )
            return gateway_for(s.gateway).open(episode.rollout_uuid, spec)
        if s.endpoint.base_url:
            return s.endpoint.base_url.rstrip("/")
        addr = str(engine.choose_server())
        addr = addr if addr.startswith(("http://", "https://")) else f"http://{addr}"
        return f"{addr.rstrip('/')}/v1"

    def close_model_endpoint(self, episode: Episode) -> None:
        """Stop serving the episode's agent and keep what the gateway captured (idempotent)."""
        gateway = self.settings.endpoint.mode == "gateway"
        if gateway and episode.model_base_url and episode.capture is None:
            episode.capture = gateway_for(self.settings.gateway).close(episode.rollout_uuid)

    def model_name(self) -> str:
        return self.settings.endpoint.model_name or self.settings.processor_path

    # ------------------------------------------------------------------ hooks

    def build_run_spec(self, episode: Episode) -> RunSpec:
        """The agent run request. Override to change the instruction or the model options."""
        s, data = self.settings, episode.data
        instruction = data.get("instruction") or data.get("description") or data.get("name")
        options = {
            "temperature": s.sampling.temperature,
            "maxTokens": s.sampling.max_new_tokens,
            **s.agent.run_model_options(),
            **s.agent.model_options,
        }
        return RunSpec(
            task=str(instruction),
            model_base_url=episode.model_base_url,
            model_name=self.model_name(),
            gym_base_url=s.gym.base_url,
            gym_id=s.gym.gym_id,
            execution_id=str(episode.execution_id),
            agent=s.agent.agent,
            max_steps=s.agent.max_steps,
            max_run_time_s=s.agent.max_run_time_s,
            max_step_time_s=s.agent.max_step_time_s,
            provider=s.endpoint.provider,
            action_space=s.agent.action_space,
            model_options=options,
        )

    async def run_agent(self, spec: RunSpec) -> RunResult:
        """The agent run, to its end: on the agent service (``agent.mode: service``) or, with
        ``builtin``, the same loop as the local agent's run here, in the episode's task."""
        a = self.settings.agent
        if a.mode == "builtin":
            return await run_builtin(self.services.agent_loop(a.builtin), spec, a.driver.deadline_s)
        agent = self.services.clients()[1]
        if agent is None:
            raise ConfigError("agent.mode=service needs agent.base_url (or agent.mode=builtin)")
        return await RunDriver(agent, a.driver).run(spec)

    def compute_reward(self, episode: Episode) -> RewardOutcome:
        """Evaluation -> reward (raises RejectedEpisode when the gym gave no verdict)."""
        parsed = episode.parsed
        turns = parsed.turns if parsed else []
        facts = EpisodeFacts.from_turns(turns)
        return compute_reward(episode.evaluation.raw, facts, self.settings.reward)

    async def build_row(self, episode: Episode) -> ConversionResult:
        """Turns -> one training row, from the gateway's capture (or, direct mode, the events
        and the images they name). Conversion (image processing) runs in a thread so the
        rollout event loop never blocks."""
        cfg, turns = self.settings.trajectory, episode.parsed.turns
        if episode.capture is not None:
            turns, fetched = episode.capture.row_turns(turns), episode.capture.images()
        else:
            urls = image_urls_needed(turns, cfg)
            try:
                fetched = await fetch_images(urls, cfg, client=self.services.clients()[2])
            except RejectedEpisode as exc:
                return ConversionResult(None, exc.reason, exc.detail, {"turns": len(turns)})
        return await asyncio.to_thread(
            convert_turns,
            turns,
            processor=self.processor,
            reward=episode.reward.reward,
            version=episode.version,
            config=cfg,
            fetched_images=fetched,
            episode_id=episode_id_of(episode.rollout_uuid),
        )

    async def record_episode(self, episode: Episode, recorder: RolloutRecorder) -> None:
        """Send turns, actions (with tokens and logprobs), observations to the monitor."""
        if recorder.enabled and episode.parsed is not None:
            # Screenshots are downscaled and kept by the monitor (presigned URLs expire).
            await recorder.record_turns(
                episode.monitor_turns(),
                images=episode.capture.images() if episode.capture else None,
                fetch=http_fetcher(self.settings.trajectory, self.services.clients()[2]),
            )

    async def store_episode(self, episode: Episode, recorder: RolloutRecorder) -> None:
        """Keep an accepted train episode in the trajectory warehouse (``monitor.store_episodes``:
        successes by default), so its rows can be rebuilt exactly for replay and export."""
        policy, result = self.settings.store_episodes, episode.conversion
        if not recorder.enabled or self.settings.phase != "train" or policy == "none":
            return
        if policy == "successes" and not episode.reward.success:
            return
        recorder.client.store_episode(
            stored_episode_of(
                result,
                episode.parsed.turns if episode.parsed else [],
                task_id=episode.task_id,
                rollout_uuid=episode.rollout_uuid,
                training=self.settings.training_ref,
                success=bool(episode.reward.success),
            )
        )

    async def fetch_for_replay(self, task_id: str, version: int, pool: replay.ReplayPool) -> None:
        """The recorded successes of ``task_id`` in the trainings ``replay.trainings`` names, from
        the monitor's episode store, rebuilt into the pool (once per task and policy version).
        A failed read or rebuild is counted (``cua/replay/fetch_errors``), never raised."""
        cfg = self.settings.group.replay
        client = await self.services.monitor_client()
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
                rows = await asyncio.to_thread(rebuild_rows, stored, self.processor)
                pool.add(replay.recorded_of(stored, rows))
        except (MonitorError, RebuildError, StoredEpisodeError) as exc:
            self._replay_error("cua/replay/fetch_errors", task_id, exc)

    # ------------------------------------------------------------------ the episode

    def monitor_source(self, version: int) -> MonitorContext:
        s = self.settings
        return rollout_source(s.training_ref, s.phase, workflow_context.get().is_eval, version)

    def is_surplus(self, version: int) -> bool:
        s = self.settings
        return is_surplus(s.phase, workflow_context.get().is_eval, s.total_steps, version)

    @drained_episode
    async def arun_episode(self, engine, data: dict[str, Any]) -> dict[str, Any] | None:
        if self.settings.endpoint.mode == "gateway":
            http = self.services.clients()[2]
            pause_for_held_calls(
                self.pauses(), self.settings.pause, http, phase=self.settings.phase
            )
        waited = await self.pauses().admit()
        scope = workflow_context.stat_scope()
        episode = Episode(
            data=dict(data), rollout_uuid=str(uuid.uuid4()), version=int(engine.get_version())
        )
        if waited:
            episode.timings["pause_wait_s"] = waited
        surplus = self.is_surplus(episode.version)
        if surplus:
            log.info(
                "episode %s samples policy version %d after the last step: not recorded",
                episode.rollout_uuid,
                episode.version,
            )
        recorder = RolloutRecorder(
            None if surplus else await self.services.monitor_client(),
            episode.rollout_uuid,
            task_id=episode.task_id,
            model_path=self.settings.processor_path,
            source=self.monitor_source(episode.version),
            task={
                "name": data.get("name") or episode.task_id,
                "description": data.get("description") or "",
            },
        )
        t0 = time.monotonic()
        try:
            run = self._run(engine, episode, recorder)
            row = await run_drained(run, episode, recorder, self.services, self.settings.drain)
        except RejectedEpisode as exc:
            self._count(scope, episode, reason=exc.reason)
            log.warning("episode %s rejected: %s", episode.rollout_uuid, exc)
            self.pause_for(engine, episode, exc)
            await recorder.fail(exc.reason, error_message=str(exc))
            return None
        except CuaRlError as exc:
            reason = type(exc).__name__
            self._count(scope, episode, reason=reason)
            log.warning("episode %s failed: %s", episode.rollout_uuid, exc)
            await recorder.fail(reason, error_message=str(exc))
            return None
        episode.timings["total"] = time.monotonic() - t0
        self._count(scope, episode, reason=None)
        await self.remember_for_replay(episode)
        return row

    async def remember_for_replay(self, episode: Episode) -> None:
        """With ``replay.enabled``: tell the group filter which task this episode ran, and keep a
        success's rows, rebuilt from its stored form (what the warehouse keeps), for replay into
        later all-fail groups of its task (``cua_rl.warehouse.replay``)."""
        s = self.settings
        cfg = s.group.replay
        if s.phase != "train" or not cfg.enabled:
            return
        pool = replay.pool(cfg.pool_per_task)
        result = episode.conversion
        pool.note(
            episode_id_of(episode.rollout_uuid),
            episode.task_id,
            episode.version,
            episode.rollout_uuid,
            success=bool(episode.reward.success),
        )
        client = await self.services.monitor_client()
        if client is not None:
            # The filter runs in this event loop: it shows replays through this client.
            pool.monitor = client.enqueue
        if not episode.reward.success:
            if cfg.trainings and pool.first_ask(episode.task_id, episode.version):
                await self.fetch_for_replay(episode.task_id, episode.version, pool)
            return
        try:
            stored = stored_from_rows(
                result.rows,
                result.row_images,
                task_id=episode.task_id,
                rollout_uuid=episode.rollout_uuid,
                training=s.group.training,
                success=True,
                images=result.image_data,
                row_turns=result.row_turns,
            )
            rows = await asyncio.to_thread(rebuild_rows, stored, self.processor)
        except (RebuildError, StoredEpisodeError, KeyError) as exc:
            # The episode trains as it is; only its replay is lost, and counted.
            self._replay_error("cua/replay/record_errors", episode.task_id, exc)
            return
        pool.add(replay.recorded_of(stored, rows))

    def _replay_error(self, key: str, task_id: str, exc: Exception) -> None:
        from areal.utils import stats_tracker

        stats_tracker.get(workflow_context.stat_scope()).scalar(**{key: 1.0})
        log.warning("replay of %s: %s: %s", task_id, key, exc)

    async def _run(self, engine, episode: Episode, recorder: RolloutRecorder):
        await recorder.start()
        episode.model_base_url = self.open_model_endpoint(engine, episode)
        try:
            await self._act(episode, recorder)
        except RejectedEpisode as exc:
            self.close_model_endpoint(episode)
            sharper = gateway_reason(episode.capture, exc.reason.removeprefix(AGENT_PREFIX))
            if exc.reason.startswith(AGENT_PREFIX) and sharper:
                raise RejectedEpisode(sharper, exc.detail) from exc
            raise
        finally:
            self.close_model_endpoint(episode)
        episode.parsed = events_to_turns(episode.run.events)
        episode.reward = self.compute_reward(episode)
        await recorder.validation(
            success=episode.reward.success,
            score=episode.reward.base,
            details_json=episode.evaluation.raw,
        )
        async with Phase(episode, "convert_s"):
            episode.conversion = await self.build_row(episode)
            # The episode's screenshots were processed in pool threads (cua_rl/heap.py).
            await asyncio.to_thread(release_free_memory)
        await self.record_episode(episode, recorder)
        result = episode.conversion
        if result.row is None:
            raise RejectedEpisode(result.reason or Reason.REJECTED, result.detail)
        await recorder.complete(
            reward=episode.reward.reward,
            task_success=int(episode.reward.success),
            metrics_json={"conversion": result.stats, "timings": episode.timings},
        )
        await self.store_episode(episode, recorder)
        return result.row

    async def _act(self, episode: Episode, recorder: RolloutRecorder) -> None:
        """Execution, agent run, evaluation; the execution is terminated on every exit."""
        genv = self.services.clients()[0]
        await recorder.environment("creating")
        t_create = time.monotonic()
        try:
            async with genv.execution(episode.task_id) as handle:
                episode.timings["env_create_s"] = time.monotonic() - t_create
                episode.execution_id, episode.box_id = handle.execution_id, handle.box_id
                await recorder.environment("running", gbox_id=episode.box_id)
                spec = self.build_run_spec(episode)
                async with Phase(episode, "agent_s"):
                    episode.run = await self.run_agent(spec)
                summary = episode.run.summary
                if summary.status != "completed":
                    raise RejectedEpisode(
                        agent_reason(summary.reason or summary.status),
                        f"run {summary.run_id} ended {summary.status}: {summary.errors[-3:]}",
                    )
                async with Phase(episode, "evaluate_s"):
                    episode.evaluation = await handle.evaluate(
                        execution_data={"run_id": summary.run_id, "steps": summary.steps},
                        answer_text=summary.answer,
                    )
                t_term = time.monotonic()
            episode.timings["env_terminate_s"] = time.monotonic() - t_term
        except GymError as exc:
            await recorder.environment("error", status_message=str(exc)[:500])
            raise RejectedEpisode(Reason.GYM_ERROR, str(exc)) from exc
        except asyncio.CancelledError:
            await recorder.environment("terminated", status_message=DRAIN_REASON)
            raise
        except BaseException:
            await recorder.environment("terminated")
            raise
        await recorder.environment("terminated")

    def _count(self, scope: str, episode: Episode, *, reason: str | None) -> None:
        """Stats under AReaL's rollout / eval-rollout scope and the outcome log; once per episode."""
        from areal.utils import stats_tracker

        stats_tracker.get(scope).scalar(**episode_stats(episode, reason))
        if self._outcomes is not None:
            self._outcomes.record(accepted=reason is None, reason=reason, phase=self.settings.phase)
