"""One episode as a linear pipeline: box, agent run, captured calls, evaluation, reward, rows.

``run_episode`` is the whole path, read top to bottom::

    task ─► the model endpoint: this episode's gateway session (or, direct mode, a server URL)
         ─► box: the gym creates an execution, terminated on every exit
              ─► agent run (the agent service, the built-in loop or an agent function) ─► RunResult
              ─► evaluation of the box                                          ─► EvaluationResult
         ─► captured calls: the gateway's capture and the agent's turns         ─► CapturedCalls
         ─► reward: the evaluation and the calls                                ─► RewardOutcome
         ─► rows: the calls and the reward, converted in a thread              ─► ConversionResult

Each stage is a function with typed input and output (``EpisodeStages``: the workflow supplies
them, its hooks among them; the defaults are the functions below). No stage calls the monitor,
the warehouse or replay: the pipeline emits events (``Started``, ``BoxChanged``, ``AgentRan``,
``CaptureClosed``, ``Evaluated``, ``Converted``, ``Ended``) to whoever observes the episode
(``cua_rl.rollout.observers``). A failure of the infrastructure ends it rejected with a counted
reason (``RejectedEpisode``); a task the agent failed is rows with reward 0 (docs/design.md,
decision 5).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from cua_rl.agent.spec import RunResult, RunSpec
from cua_rl.clients.genv_answers import EvaluationResult
from cua_rl.core import reasons
from cua_rl.core.reasons import AGENT_PREFIX, Reason, agent_reason
from cua_rl.errors import CuaRlError, GymError, RejectedEpisode
from cua_rl.gateway.capture import EpisodeCapture
from cua_rl.heap import release_free_memory
from cua_rl.logs import get_logger
from cua_rl.reward import EpisodeFacts, RewardConfig, RewardOutcome, compute_reward
from cua_rl.rollout.settings import WorkflowSettings
from cua_rl.trajectory import (
    ConversionResult,
    TrajectoryConfig,
    captured,
    convert_turns,
    events_to_turns,
    fetch_images,
    image_urls_needed,
)
from cua_rl.trajectory.events import Turn
from cua_rl.trajectory.rows import episode_id_of

log = get_logger(__name__)

# ---- what flows through the pipeline -------------------------------------------------------


@dataclass(frozen=True)
class EpisodeTask:
    """What an episode is given: its task row, its rollout id, the policy version it samples."""

    data: Mapping[str, Any]
    rollout_uuid: str
    version: int

    @property
    def task_id(self) -> str:
        return str(self.data["task_id"])

    @property
    def episode_id(self) -> int:
        """The id every row of the episode carries (the group filter counts episodes by it)."""
        return episode_id_of(self.rollout_uuid)

    @property
    def instruction(self) -> str:
        d = self.data
        return str(d.get("instruction") or d.get("description") or d.get("name"))


@dataclass(frozen=True)
class Box:
    """The gym execution the agent drives (its box id when the gym names one)."""

    execution_id: str
    box_id: str | None


@dataclass(frozen=True)
class CapturedCalls:
    """The agent's turns (from its event log: actions, the answer) and, through the gateway, what
    the gateway captured of every model call (exact ids, logprobs, versions, images)."""

    turns: list[Turn]
    capture: EpisodeCapture | None = None

    def row_turns(self) -> list[Turn]:
        """The row builder's turns: token data as captured, actions from the agent's events."""
        return captured.row_turns(self.capture, self.turns) if self.capture else self.turns

    def images(self) -> dict[str, bytes] | None:
        return captured.images(self.capture) if self.capture else None

    def monitor_turns(self, trained_steps: frozenset[int] | None = None) -> list[Turn]:
        """The agent's turns with the captured token data, each noting whether a row trains it
        (``trained_steps``, known once the rows are built)."""
        turns = captured.monitor_turns(self.capture, self.turns) if self.capture else self.turns
        if trained_steps is None:
            return turns
        return [replace(t, notes={**t.notes, "trained": t.step in trained_steps}) for t in turns]


@dataclass
class ModelEndpoint:
    """The agent's OpenAI base URL for one episode; ``close`` stops serving it and gives what it
    captured (``end_session``'s answer; None in direct mode), once: later calls give the same."""

    url: str
    end_session: Callable[[], EpisodeCapture | None] = lambda: None
    _closed: bool = field(default=False, init=False)
    _capture: EpisodeCapture | None = field(default=None, init=False)

    def close(self) -> EpisodeCapture | None:
        if not self._closed:
            self._closed = True
            self._capture = self.end_session()
        return self._capture


class Timings(dict):
    """Seconds per stage (``cua/time/...``): ``with timings.phase("agent_s"):``."""

    @contextmanager
    def phase(self, name: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self[name] = time.monotonic() - t0


# ---- what observers see --------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    task: EpisodeTask


@dataclass(frozen=True)
class BoxChanged:
    """The box's state: creating, running (``box`` known), terminated or error (``message``);
    ``cancelled``: terminated because the episode was cancelled (the run's end)."""

    state: str
    box: Box | None = None
    message: str = ""
    cancelled: bool = False


@dataclass(frozen=True)
class AgentRan:
    run: RunResult


@dataclass(frozen=True)
class CaptureClosed:
    """The episode's gateway session closed: what it captured (None in direct mode)."""

    capture: EpisodeCapture | None


@dataclass(frozen=True)
class Evaluated:
    evaluation: EvaluationResult
    reward: RewardOutcome
    calls: CapturedCalls


@dataclass(frozen=True)
class Converted:
    calls: CapturedCalls
    rows: ConversionResult


@dataclass(frozen=True)
class Ended:
    """How the episode ended: ``accepted`` (rows), ``rejected`` (``reason``: a counted one),
    ``failed`` (an error of cua-rl's, ``reason`` its type) or ``cancelled`` (the run's end)."""

    task: EpisodeTask
    outcome: str
    reason: str | None = None
    detail: str = ""
    error: BaseException | None = None
    calls: CapturedCalls | None = None
    reward: RewardOutcome | None = None
    rows: ConversionResult | None = None
    timings: Mapping[str, float] = field(default_factory=dict)

    @property
    def accepted(self) -> bool:
        return self.outcome == "accepted"


EpisodeEvent = Started | BoxChanged | AgentRan | CaptureClosed | Evaluated | Converted | Ended
Emit = Callable[[EpisodeEvent], Awaitable[None]]


class ExecutionHandle(Protocol):
    """A live gym execution (``cua_rl.clients.genv.ExecutionHandle``)."""

    execution_id: str
    box_id: str | None

    async def evaluate(self, execution_data: Any = None, answer_text: str | None = None): ...


@dataclass(frozen=True)
class EpisodeStages:
    """The stages ``run_episode`` calls, in its order."""

    open_endpoint: Callable[[EpisodeTask], ModelEndpoint]
    open_box: Callable[[EpisodeTask], AbstractAsyncContextManager[ExecutionHandle]]
    build_run_spec: Callable[[EpisodeTask, Box, str], RunSpec]
    run_agent: Callable[[RunSpec], Awaitable[RunResult]]
    compute_reward: Callable[[EvaluationResult, CapturedCalls], RewardOutcome]
    build_rows: Callable[[EpisodeTask, CapturedCalls, RewardOutcome], Awaitable[ConversionResult]]


# ---- the pipeline ----------------------------------------------------------------------------


async def run_episode(
    task: EpisodeTask, stages: EpisodeStages, emit: Emit, timings: Timings
) -> dict[str, Any] | None:
    """The episode told to ``emit`` from ``Started`` to ``Ended``: its rows as one batch (what
    AReaL trains), or None when it was rejected (a counted reason) or failed. Cancelled, it
    raises: the drain tells its end."""
    t0 = time.monotonic()
    try:
        calls, reward, rows = await episode_path(task, stages, emit, timings)
    except RejectedEpisode as exc:
        log.warning("episode %s rejected: %s", task.rollout_uuid, exc)
        await emit(Ended(task, "rejected", exc.reason, exc.detail, exc, timings=timings))
        return None
    except CuaRlError as exc:
        log.warning("episode %s failed: %s", task.rollout_uuid, exc)
        await emit(Ended(task, "failed", type(exc).__name__, str(exc), exc, timings=timings))
        return None
    timings["total"] = time.monotonic() - t0
    await emit(Ended(task, "accepted", calls=calls, reward=reward, rows=rows, timings=timings))
    return rows.row


async def episode_path(
    task: EpisodeTask, stages: EpisodeStages, emit: Emit, timings: Timings
) -> tuple[CapturedCalls, RewardOutcome, ConversionResult]:
    """The pipeline, stage by stage; ``RejectedEpisode`` when the episode has no rows."""
    await emit(Started(task))
    endpoint = stages.open_endpoint(task)
    try:
        run, evaluation = await in_box(task, stages, endpoint.url, emit, timings)
    except RejectedEpisode as exc:
        sharper = sharpened(exc, endpoint.close())
        if sharper is not None:
            raise sharper from exc
        raise
    finally:
        # The agent's calls end here; the capture is kept, and told whatever the end (its
        # counters are the episode's, rejected or not).
        await emit(CaptureClosed(endpoint.close()))
    calls = captured_calls(run, endpoint.close())
    reward = stages.compute_reward(evaluation, calls)
    await emit(Evaluated(evaluation, reward, calls))
    with timings.phase("convert_s"):
        rows = await stages.build_rows(task, calls, reward)
        # The episode's screenshots were processed in pool threads (cua_rl/heap.py).
        await asyncio.to_thread(release_free_memory)
    await emit(Converted(calls, rows))
    rows.raise_if_rejected()
    return calls, reward, rows


async def in_box(
    task: EpisodeTask, stages: EpisodeStages, model_url: str, emit: Emit, timings: Timings
) -> tuple[RunResult, EvaluationResult]:
    """The box's life: created, the agent's run in it, evaluated, terminated on every exit."""
    await emit(BoxChanged("creating"))
    t0 = time.monotonic()
    try:
        async with stages.open_box(task) as handle:
            timings["env_create_s"] = time.monotonic() - t0
            box = Box(handle.execution_id, handle.box_id)
            await emit(BoxChanged("running", box))
            spec = stages.build_run_spec(task, box, model_url)
            with timings.phase("agent_s"):
                run = await stages.run_agent(spec)
            await emit(AgentRan(run))
            check_completed(run)
            with timings.phase("evaluate_s"):
                evaluation = await evaluate(handle, run)
            t_term = time.monotonic()
        timings["env_terminate_s"] = time.monotonic() - t_term
    except GymError as exc:
        await emit(BoxChanged("error", message=str(exc)[:500]))
        raise RejectedEpisode(Reason.GYM_ERROR, str(exc)) from exc
    except asyncio.CancelledError:
        await emit(BoxChanged("terminated", cancelled=True))
        raise
    except BaseException:
        await emit(BoxChanged("terminated"))
        raise
    await emit(BoxChanged("terminated"))
    return run, evaluation


# ---- the stages' defaults ------------------------------------------------------------------


def run_spec(
    task: EpisodeTask, box: Box, model_base_url: str, settings: WorkflowSettings, model_name: str
) -> RunSpec:
    """The agent run an episode asks for: the task's instruction, the agent's limits, and the
    sampling settings (through the gateway the trainer's win anyway) merged into the model
    object with the context policy and ``agent.model_options``."""
    s = settings
    options = {
        "temperature": s.sampling.temperature,
        "maxTokens": s.sampling.max_new_tokens,
        **s.agent.run_model_options(),
        **s.agent.model_options,
    }
    return RunSpec(
        task=task.instruction,
        model_base_url=model_base_url,
        model_name=model_name,
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


def check_completed(run: RunResult) -> None:
    """A run that did not complete rejects the episode with the agent's reason."""
    summary = run.summary
    if summary.status != "completed":
        raise RejectedEpisode(
            agent_reason(summary.reason or summary.status),
            f"run {summary.run_id} ended {summary.status}: {summary.errors[-3:]}",
        )


async def evaluate(handle: ExecutionHandle, run: RunResult) -> EvaluationResult:
    """The gym's verdict on the box, given the run and the agent's final answer."""
    summary = run.summary
    return await handle.evaluate(
        execution_data={"run_id": summary.run_id, "steps": summary.steps},
        answer_text=summary.answer,
    )


def captured_calls(run: RunResult, capture: EpisodeCapture | None) -> CapturedCalls:
    """The agent's turns from its event log, beside what the gateway captured."""
    return CapturedCalls(events_to_turns(run.events).turns, capture)


def reward_of(
    evaluation: EvaluationResult, calls: CapturedCalls, config: RewardConfig
) -> RewardOutcome:
    """Evaluation -> reward (raises RejectedEpisode when the gym gave no verdict)."""
    return compute_reward(evaluation.raw, EpisodeFacts.from_turns(calls.turns), config)


async def rows_of(
    task: EpisodeTask,
    calls: CapturedCalls,
    reward: RewardOutcome,
    *,
    processor: Any,
    config: TrajectoryConfig,
    http: Any,
) -> ConversionResult:
    """Calls -> an episode's rows, from the gateway's capture (direct mode: the events and the
    images they name, fetched with ``http``). Conversion (image processing) runs in a thread so
    the rollout event loop never blocks."""
    turns, fetched = calls.row_turns(), calls.images()
    if calls.capture is None:
        try:
            fetched = await fetch_images(image_urls_needed(turns, config), config, client=http)
        except RejectedEpisode as exc:
            return ConversionResult(None, exc.reason, exc.detail, {"turns": len(turns)})
    return await asyncio.to_thread(
        convert_turns,
        turns,
        processor=processor,
        reward=reward.reward,
        version=task.version,
        config=config,
        fetched_images=fetched,
        episode_id=task.episode_id,
    )


def sharpened(exc: RejectedEpisode, capture: EpisodeCapture | None) -> RejectedEpisode | None:
    """A sharper rejection than the agent's when the gateway knows why its run failed."""
    if capture is None or not exc.reason.startswith(AGENT_PREFIX):
        return None
    if capture.errors:
        return RejectedEpisode(reasons.gateway_reason(capture.errors[-1].code), exc.detail)
    run_reason = exc.reason.removeprefix(AGENT_PREFIX)
    if not capture.turns and run_reason in ("model_error", "step_timeout", "timeout"):
        # The agent never got through: the advertised gateway URL is not reachable from it.
        return RejectedEpisode(Reason.GATEWAY_UNREACHABLE, exc.detail)
    return None
