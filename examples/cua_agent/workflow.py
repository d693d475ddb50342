"""``CUAAgentWorkflow``: one AReaL episode = one gym execution driven by one agent run.

The workflow only orchestrates. Per episode it creates a gym execution (terminated on every exit,
cancellation included), starts a gbox-mini-agent run whose model endpoint is one of the engine's
inference servers, waits for it, evaluates the execution, computes the reward, and turns the run's
event log into one training row with the pure functions of ``cua_rl.trajectory``. Infrastructure
failures return ``None`` with a counted reason; a task the agent failed is a row with reward 0.

Users customise it by overriding the hooks: ``build_run_spec``, ``compute_reward``, ``build_row``
and ``record_episode`` (see the README for an example).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
from areal import workflow_context
from areal.api.workflow_api import RolloutWorkflow

from cua_rl.errors import ConfigError, CuaRlError, GymError, RejectedEpisode
from cua_rl.genv import EvaluationResult, GenvClient

# The group filters live in cua_rl.groups; re-exported for the dotted paths in use.
from cua_rl.groups import GROUP_SIZE_ENV, complete_groups  # noqa: F401
from cua_rl.logs import get_logger
from cua_rl.mini_agent import MiniAgentClient, RunDriver, RunResult, RunSpec
from cua_rl.monitor.client import MonitorClient, MonitorClientConfig
from cua_rl.monitor.context import MonitorContext
from cua_rl.monitor.recorder import RolloutRecorder
from cua_rl.reward import EpisodeFacts, RewardOutcome, compute_reward
from cua_rl.trajectory import ConversionResult, convert_turns, events_to_turns, fetch_images
from cua_rl.trajectory.events import ParsedEvents
from examples.cua_agent.config import WorkflowSettings
from examples.cua_agent.lifecycle import baseline_client_id, eval_client_id, step_client_id

log = get_logger("cua_rl.workflow")

# How long a cancelled episode waits for its last monitor records to go out.
CANCEL_FLUSH_S = 5.0


@dataclass
class Episode:
    """What one episode produced so far; hooks read and extend it."""

    data: dict[str, Any]
    rollout_uuid: str
    version: int
    model_base_url: str = ""
    execution_id: str | None = None
    box_id: str | None = None
    run: RunResult | None = None
    evaluation: EvaluationResult | None = None
    parsed: ParsedEvents | None = None
    reward: RewardOutcome | None = None
    conversion: ConversionResult | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def task_id(self) -> str:
        return str(self.data["task_id"])


def _settings(obj: WorkflowSettings | dict) -> WorkflowSettings:
    if isinstance(obj, WorkflowSettings):
        return obj
    raise ConfigError(
        f"CUAAgentWorkflow needs a WorkflowSettings (CUAConfig.workflow_settings()), got "
        f"{type(obj).__name__}"
    )


class _Phase:
    """``async with self._phase(ep, "agent"):`` records the phase's wall time in the episode."""

    def __init__(self, episode: Episode, name: str):
        self.episode, self.name = episode, name

    async def __aenter__(self):
        self.t0 = time.monotonic()

    async def __aexit__(self, *exc):
        self.episode.timings[self.name] = time.monotonic() - self.t0


class CUAAgentWorkflow(RolloutWorkflow):
    """AReaL rollout workflow for GUI agents driven by gbox-mini-agent (or the local stand-in)."""

    def __init__(self, settings: WorkflowSettings, processor: Any = None):
        self.settings = _settings(settings)
        self._processor = processor
        self._clients: dict[int, tuple[GenvClient, MiniAgentClient, httpx.AsyncClient]] = {}
        self._monitor: MonitorClient | None = None
        self._server_cycle: itertools.cycle | None = None

    # ------------------------------------------------------------------ resources

    @property
    def processor(self):
        if self._processor is None:
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self.settings.processor_path)
        return self._processor

    def _loop_clients(self) -> tuple[GenvClient, MiniAgentClient, httpx.AsyncClient]:
        # httpx clients are bound to the loop they were created on; AReaL may run workflows on a
        # new loop after a restart, so keep one set per loop.
        key = id(asyncio.get_running_loop())
        if key not in self._clients:
            s = self.settings
            http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0))
            genv = GenvClient(s.gym.base_url, s.gym.gym_id, client=http, timeouts=s.gym.timeouts)
            agent = MiniAgentClient(s.agent.base_url, client=http)
            self._clients[key] = (genv, agent, http)
        return self._clients[key]

    async def _monitor_client(self) -> MonitorClient | None:
        s = self.settings
        if not s.monitor_base_url:
            return None
        if self._monitor is None:
            cfg = MonitorClientConfig(
                base_url=s.monitor_base_url,
                token=s.monitor_token or None,
                spool_path=s.monitor_spool_path or None,
            )
            self._monitor = MonitorClient(cfg)
            await self._monitor.start()
        return self._monitor

    async def aclose(self) -> None:
        """Flush the monitor and close HTTP clients (tests and train.py call this)."""
        if self._monitor is not None:
            await self._monitor.close()
            self._monitor = None
        for *_, http in self._clients.values():
            await http.aclose()
        self._clients.clear()

    def model_base_url(self, engine) -> str:
        """The OpenAI base URL for this episode: the configured override, or the engine's
        inference servers in turn (so a group's members spread across servers)."""
        if self.settings.endpoint.base_url:
            return self.settings.endpoint.base_url.rstrip("/")
        inner = getattr(engine, "_engine", engine)
        choose = getattr(inner, "choose_server", None)
        if callable(choose):
            addr = choose()
        else:
            addresses = getattr(inner, "addresses", None)
            if not addresses:
                raise ConfigError(
                    "the inference engine exposes no server addresses; set endpoint.base_url"
                )
            if self._server_cycle is None:
                self._server_cycle = itertools.cycle(list(addresses))
            addr = next(self._server_cycle)
        addr = str(addr)
        if not addr.startswith(("http://", "https://")):
            addr = f"http://{addr}"
        return f"{addr.rstrip('/')}/v1"

    def model_name(self) -> str:
        return self.settings.endpoint.model_name or self.settings.processor_path

    # ------------------------------------------------------------------ hooks

    def build_run_spec(self, episode: Episode) -> RunSpec:
        """The agent run request. Override to change the instruction or the model options."""
        s, data = self.settings, episode.data
        instruction = data.get("instruction") or data.get("description") or data.get("name")
        options = {
            "temperature": s.temperature,
            "maxTokens": s.max_new_tokens,
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

    def compute_reward(self, episode: Episode) -> RewardOutcome:
        """Evaluation -> reward (raises RejectedEpisode when the gym gave no verdict)."""
        parsed = episode.parsed
        turns = parsed.turns if parsed else []
        facts = EpisodeFacts.from_turns(turns)
        return compute_reward(episode.evaluation.raw, facts, self.settings.reward)

    async def build_row(self, episode: Episode) -> ConversionResult:
        """Turns -> one training row. Image bytes are fetched here; conversion (CPU-heavy image
        processing) runs in a thread so the rollout event loop never blocks."""
        cfg = self.settings.trajectory
        turns = episode.parsed.turns
        urls = [u for t in turns[-1:] for u in t.image_urls]
        try:
            fetched = await fetch_images(urls, cfg, client=self._loop_clients()[2])
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
        )

    async def record_episode(self, episode: Episode, recorder: RolloutRecorder) -> None:
        """Send turns, actions (with tokens and logprobs), observations to the monitor."""
        if not recorder.enabled or episode.parsed is None:
            return
        for turn in episode.parsed.turns:
            n = turn.step
            await recorder.turn_start(n)
            await recorder.turn_end(
                n,
                model_response=turn.text,
                finish_reason=turn.finish_reason,
                prompt_tokens=len(turn.prompt_ids or []),
                output_tokens=len(turn.output_ids or []),
            )
            for i, action in enumerate(turn.actions):
                # The reply's tokens belong to the turn's first action (one reply per turn).
                first = i == 0
                await recorder.action(
                    n,
                    i,
                    str(action.get("name", "unknown")),
                    dict(action.get("args") or {}),
                    tokens=list(turn.output_ids or []) if first else None,
                    logprobs=list(turn.output_logprobs or []) if first else None,
                )
            if turn.image_urls:
                url = turn.image_urls[-1]
                # data: URLs are megabytes; keep a reference, not the pixels.
                uri = url if not url.startswith("data:") else f"data-url:{len(url)}B"
                await recorder.observation(n, 0, obs_type="screenshot", screenshot_uri=uri)

    # ------------------------------------------------------------------ the episode

    def monitor_source(self, version: int) -> MonitorContext:
        """Where this episode's rollout belongs (see examples/cua_agent/lifecycle.py for the ids):
        the baseline pass, the eval pass of policy ``version``, or the step that trains it."""
        s = self.settings
        run = s.training_ref
        if not run:
            return MonitorContext()
        if s.phase == "baseline":
            return MonitorContext(training_id=run, baseline_id=baseline_client_id(run))
        if s.phase == "eval" or workflow_context.get().is_eval:
            return MonitorContext(training_id=run, eval_id=eval_client_id(run, version))
        # Policy version v is trained by step v + 1 (train.py opens that step's record first).
        return MonitorContext(training_id=run, step_id=step_client_id(run, version + 1))

    def is_surplus(self, version: int) -> bool:
        """A training rollout of a policy the run never trains again: the trainer prefetches a
        batch after the last step, and those episodes belong to no step record."""
        s = self.settings
        in_training = s.phase == "train" and not workflow_context.get().is_eval
        return in_training and bool(s.total_steps) and version + 1 > s.total_steps

    async def arun_episode(self, engine, data: dict[str, Any]) -> dict[str, Any] | None:
        scope = workflow_context.stat_scope()
        episode = Episode(
            data=dict(data), rollout_uuid=str(uuid.uuid4()), version=int(engine.get_version())
        )
        surplus = self.is_surplus(episode.version)
        if surplus:
            log.info(
                "episode %s samples policy version %d after the last step: not recorded",
                episode.rollout_uuid,
                episode.version,
            )
        recorder = RolloutRecorder(
            None if surplus else await self._monitor_client(),
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
            row = await self._run(engine, episode, recorder)
        except RejectedEpisode as exc:
            self._count(scope, episode, reason=exc.reason)
            log.warning("episode %s rejected: %s", episode.rollout_uuid, exc)
            await recorder.fail(exc.reason, error_message=str(exc))
            return None
        except asyncio.CancelledError:
            await recorder.fail("cancelled")
            # A cancel usually means the trainer is stopping: AReaL cancels the episodes, awaits
            # them, then ends the loop that would have sent these last records. Send them now.
            if self._monitor is not None:
                await self._monitor.flush(timeout=CANCEL_FLUSH_S)
            raise
        except CuaRlError as exc:
            reason = type(exc).__name__
            self._count(scope, episode, reason=reason)
            log.warning("episode %s failed: %s", episode.rollout_uuid, exc)
            await recorder.fail(reason, error_message=str(exc))
            return None
        episode.timings["total"] = time.monotonic() - t0
        self._count(scope, episode, reason=None)
        return row

    async def _run(self, engine, episode: Episode, recorder: RolloutRecorder):
        genv, agent, _ = self._loop_clients()
        s = self.settings
        await recorder.start()
        episode.model_base_url = self.model_base_url(engine)
        await recorder.environment("creating")
        t_create = time.monotonic()
        try:
            # The scope terminates the execution on every exit (errors, cancellation, deadlines).
            async with genv.execution(episode.task_id) as handle:
                episode.timings["env_create_s"] = time.monotonic() - t_create
                episode.execution_id, episode.box_id = handle.execution_id, handle.box_id
                await recorder.environment("running", gbox_id=episode.box_id)
                spec = self.build_run_spec(episode)
                async with _Phase(episode, "agent_s"):
                    episode.run = await RunDriver(agent, s.agent.driver).run(spec)
                summary = episode.run.summary
                if summary.status != "completed":
                    raise RejectedEpisode(
                        f"agent_{summary.reason or summary.status}",
                        f"run {summary.run_id} ended {summary.status}: {summary.errors[-3:]}",
                    )
                async with _Phase(episode, "evaluate_s"):
                    episode.evaluation = await handle.evaluate(
                        execution_data={"run_id": summary.run_id, "steps": summary.steps},
                        answer_text=summary.answer,
                    )
                t_term = time.monotonic()
            episode.timings["env_terminate_s"] = time.monotonic() - t_term
        except GymError as exc:
            await recorder.environment("error", status_message=str(exc)[:500])
            raise RejectedEpisode("gym_error", str(exc)) from exc
        except BaseException:
            await recorder.environment("terminated")
            raise
        await recorder.environment("terminated")

        episode.parsed = events_to_turns(episode.run.events)
        episode.reward = self.compute_reward(episode)
        await recorder.validation(
            success=episode.reward.success,
            score=episode.reward.base,
            details_json=episode.evaluation.raw,
        )
        async with _Phase(episode, "convert_s"):
            episode.conversion = await self.build_row(episode)
        await self.record_episode(episode, recorder)
        result = episode.conversion
        if result.row is None:
            raise RejectedEpisode(result.reason or "rejected", result.detail)
        await recorder.complete(
            reward=episode.reward.reward,
            task_success=int(episode.reward.success),
            metrics_json={"conversion": result.stats, "timings": episode.timings},
        )
        return result.row

    def _count(self, scope: str, episode: Episode, *, reason: str | None) -> None:
        """Stats under AReaL's rollout / eval-rollout scope; one call per episode."""
        from areal.utils import stats_tracker

        tracker = stats_tracker.get(scope)
        stats: dict[str, float] = {"cua/accepted": 0.0 if reason else 1.0}
        if reason:
            stats[f"cua/rejected/{reason}"] = 1.0
        if episode.reward is not None:
            stats["cua/reward"] = episode.reward.reward
            # AReaL merges worker stats as means; E[r^2] lets train.py derive the spread.
            stats["cua/reward_sq"] = episode.reward.reward**2
            stats["cua/success"] = float(episode.reward.success)
        conv = episode.conversion
        if conv is not None:
            for key in ("turns", "trained_tokens", "images", "prefix_breaks", "row_len"):
                if key in conv.stats:
                    stats[f"cua/{key}"] = float(conv.stats[key])
        for key, value in episode.timings.items():
            stats[f"cua/time/{key}"] = float(value)
        tracker.scalar(**stats)
