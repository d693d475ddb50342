"""One episode as a linear pipeline: box, agent run, captured calls, evaluation, reward, rows.

``run_episode`` is the whole path, read top to bottom::

    task ─► the model endpoint: this episode's gateway session (or, direct mode, a server URL)
         ─► box: the gym creates an execution, terminated on every exit
              ─► hooks.build_run_spec                                           ─► RunSpec
              ─► hooks.run_agent (the agent service, the built-in loop or a function) ─► RunResult
              ─► evaluation of the box                                          ─► EvaluationResult
         ─► captured calls: the gateway's capture and the agent's turns         ─► CapturedCalls
         ─► hooks.compute_reward: the evaluation and the calls                  ─► RewardOutcome
         ─► hooks.build_rows: the calls and the reward                          ─► ConversionResult

The stages a project changes are the workflow's hooks, called here directly (``EpisodeHooks``:
``CUAAgentWorkflow`` holds their implementations, a subclass overrides them); the model endpoint
and the box are the worker runtime's (``EpisodeServices``). A hook that raises anything but a
``RejectedEpisode`` or an error of cua-rl's own ends the episode rejected ``hook_<hook>``, the
exception and the hook named in the detail: nothing but cancellation leaves ``run_episode``.

No stage calls the monitor, the warehouse or replay: the pipeline emits events (``Started``,
``BoxChanged``, ``AgentRan``, ``CaptureClosed``, ``Evaluated``, ``Converted``, ``Ended``) to the
episode's observers, each an ``EpisodeObserver`` with one method per event kind
(``cua_rl.rollout.observers`` lists them and keeps what they raise out of the episode). A failure
of the infrastructure ends it rejected with a counted reason (``RejectedEpisode``); a task the
agent failed is rows with reward 0 (docs/design.md, decision 5).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

from cua_rl.agent.spec import RunResult, RunSpec
from cua_rl.clients.genv_answers import EvaluationResult
from cua_rl.core import reasons
from cua_rl.core.reasons import AGENT_PREFIX, Reason, agent_reason, hook_reason
from cua_rl.errors import CuaRlError, GymError, RejectedEpisode
from cua_rl.gateway.capture import EpisodeCapture
from cua_rl.heap import release_free_memory
from cua_rl.logs import get_logger
from cua_rl.reward import RewardOutcome
from cua_rl.trajectory import ConversionResult, captured, events_to_turns
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
    kind: ClassVar[str] = "started"

    task: EpisodeTask


@dataclass(frozen=True)
class BoxChanged:
    """The box's state: creating, running (``box`` known), terminated or error (``message``);
    ``cancelled``: terminated because the episode was cancelled (the run's end)."""

    kind: ClassVar[str] = "box_changed"

    state: str
    box: Box | None = None
    message: str = ""
    cancelled: bool = False


@dataclass(frozen=True)
class AgentRan:
    kind: ClassVar[str] = "agent_ran"

    run: RunResult


@dataclass(frozen=True)
class CaptureClosed:
    """The episode's gateway session closed: what it captured (None in direct mode)."""

    kind: ClassVar[str] = "capture_closed"

    capture: EpisodeCapture | None


@dataclass(frozen=True)
class Evaluated:
    kind: ClassVar[str] = "evaluated"

    evaluation: EvaluationResult
    reward: RewardOutcome
    calls: CapturedCalls


@dataclass(frozen=True)
class Converted:
    kind: ClassVar[str] = "converted"

    calls: CapturedCalls
    rows: ConversionResult


@dataclass(frozen=True)
class Ended:
    """How the episode ended: ``accepted`` (rows), ``rejected`` (``reason``: a counted one),
    ``failed`` (an error of cua-rl's, ``reason`` its type) or ``cancelled`` (the run's end)."""

    kind: ClassVar[str] = "ended"

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


class EpisodeObserver:
    """Who watches an episode: one method per event kind, in the order the pipeline emits them,
    each doing nothing unless a subclass overrides it. An observer cannot change the episode: it
    gets frozen events, and whatever it raises is logged (once per observer and event kind) and
    counted as ``cua/observer_errors/<name>``, and the episode goes on as it would have
    (``cua_rl.rollout.observers``). ``name``: that stat's name (default: the class's name)."""

    name: ClassVar[str] = ""

    async def started(self, event: Started) -> None:
        """The episode starts (its task and rollout id are known; nothing exists yet)."""

    async def box_changed(self, event: BoxChanged) -> None:
        """The box is creating, running (``event.box``), terminated or in error."""

    async def agent_ran(self, event: AgentRan) -> None:
        """The agent's run ended (completed or not), with its events."""

    async def capture_closed(self, event: CaptureClosed) -> None:
        """The episode's gateway session closed: what it captured, whatever the episode's end."""

    async def evaluated(self, event: Evaluated) -> None:
        """The gym's verdict and the reward the workflow computed from it."""

    async def converted(self, event: Converted) -> None:
        """The rows built (or the reason they were not)."""

    async def ended(self, event: Ended) -> None:
        """The episode's end, once: accepted, rejected, failed or cancelled."""

    async def on(self, event: EpisodeEvent) -> None:
        """Tell this observer ``event``: its method for the event's kind."""
        await getattr(self, event.kind)(event)


class ExecutionHandle(Protocol):
    """A live gym execution (``cua_rl.clients.genv.ExecutionHandle``)."""

    execution_id: str
    box_id: str | None

    async def evaluate(self, execution_data: Any = None, answer_text: str | None = None): ...


class EpisodeHooks(Protocol):
    """The stages a project overrides: ``CUAAgentWorkflow``'s hooks, called by the pipeline."""

    def build_run_spec(self, task: EpisodeTask, box: Box, model_base_url: str) -> RunSpec: ...

    async def run_agent(self, spec: RunSpec, task: EpisodeTask) -> RunResult: ...

    def compute_reward(
        self, evaluation: EvaluationResult, calls: CapturedCalls
    ) -> RewardOutcome: ...

    async def build_rows(
        self, task: EpisodeTask, calls: CapturedCalls, reward: RewardOutcome
    ) -> ConversionResult: ...


class EpisodeServices(Protocol):
    """What the worker's runtime gives one episode (``cua_rl.rollout.runtime.EpisodeScope``): its
    task, its model endpoint, its box, and the log's memory of what it already explained."""

    task: EpisodeTask

    def open_endpoint(self) -> ModelEndpoint: ...

    def open_box(self) -> AbstractAsyncContextManager[ExecutionHandle]: ...

    def first_time(self, key: tuple) -> bool: ...


# ---- the pipeline ----------------------------------------------------------------------------


async def run_episode(
    episode: EpisodeServices, hooks: EpisodeHooks, emit: Emit, timings: Timings
) -> dict[str, Any] | None:
    """The episode told to ``emit`` from ``Started`` to ``Ended``: its rows as one batch (what
    AReaL trains), or None when it was rejected (a counted reason) or failed. Nothing but
    cancellation leaves it: cancelled, it raises, and the drain tells its end."""
    task, t0 = episode.task, time.monotonic()
    try:
        calls, reward, rows = await episode_path(episode, hooks, emit, timings)
    except RejectedEpisode as exc:
        log.warning("episode %s rejected: %s", task.rollout_uuid, exc)
        await emit(Ended(task, "rejected", exc.reason, exc.detail, exc, timings=timings))
        return None
    except Exception as exc:  # cua-rl's own errors, and a bug anywhere on the path
        log.warning("episode %s failed: %s: %s", task.rollout_uuid, type(exc).__name__, exc)
        if not isinstance(exc, CuaRlError) and episode.first_time(("failed", type(exc))):
            log.error("the first episode failed by %s:", type(exc).__name__, exc_info=exc)
        await emit(Ended(task, "failed", type(exc).__name__, str(exc), exc, timings=timings))
        return None
    timings["total"] = time.monotonic() - t0
    await emit(Ended(task, "accepted", calls=calls, reward=reward, rows=rows, timings=timings))
    return rows.row


async def episode_path(
    episode: EpisodeServices, hooks: EpisodeHooks, emit: Emit, timings: Timings
) -> tuple[CapturedCalls, RewardOutcome, ConversionResult]:
    """The pipeline, stage by stage; ``RejectedEpisode`` when the episode has no rows."""
    task = episode.task
    await emit(Started(task))
    endpoint = episode.open_endpoint()
    try:
        run, evaluation = await in_box(episode, hooks, endpoint.url, emit, timings)
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
    with hook(episode, hooks, "compute_reward"):
        reward = checked(hooks.compute_reward(evaluation, calls), RewardOutcome)
    await emit(Evaluated(evaluation, reward, calls))
    with timings.phase("convert_s"):
        with hook(episode, hooks, "build_rows"):
            rows = checked(await hooks.build_rows(task, calls, reward), ConversionResult)
        # The episode's screenshots were processed in pool threads (cua_rl/heap.py).
        await asyncio.to_thread(release_free_memory)
    await emit(Converted(calls, rows))
    rows.raise_if_rejected()
    return calls, reward, rows


async def in_box(
    episode: EpisodeServices, hooks: EpisodeHooks, model_url: str, emit: Emit, timings: Timings
) -> tuple[RunResult, EvaluationResult]:
    """The box's life: created, the agent's run in it, evaluated, terminated on every exit."""
    task = episode.task
    await emit(BoxChanged("creating"))
    t0 = time.monotonic()
    try:
        async with episode.open_box() as handle:
            timings["env_create_s"] = time.monotonic() - t0
            box = Box(handle.execution_id, handle.box_id)
            await emit(BoxChanged("running", box))
            with hook(episode, hooks, "build_run_spec"):
                spec = checked(hooks.build_run_spec(task, box, model_url), RunSpec)
            with timings.phase("agent_s"), hook(episode, hooks, "run_agent"):
                run = checked(await hooks.run_agent(spec, task), RunResult)
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


@contextmanager
def hook(episode: EpisodeServices, hooks: EpisodeHooks, name: str):
    """Run the workflow's hook ``name``: a ``RejectedEpisode`` or an error of cua-rl's own keeps
    its reason; anything else the hook raises rejects the episode ``hook_<name>``, naming the
    exception and the hook (its traceback logged once per hook and exception type)."""
    try:
        yield
    except (RejectedEpisode, CuaRlError):
        raise
    except Exception as exc:
        where = f"{type(hooks).__module__}.{type(hooks).__qualname__}.{name}"
        if episode.first_time(("hook", where, type(exc))):
            log.error(
                "%s raised %s (the traceback is logged once; each episode it ends is rejected %s)",
                where,
                type(exc).__name__,
                hook_reason(name),
                exc_info=exc,
            )
        detail = f"{type(exc).__name__}: {exc} (raised by {where})"
        raise RejectedEpisode(hook_reason(name), detail) from exc


def checked(value: Any, kind: type) -> Any:
    """A hook's answer, if it is of the type the pipeline takes: a wrong one is the hook's error,
    not a confusing one in the stage after it."""
    if not isinstance(value, kind):
        raise TypeError(f"returned a {type(value).__name__}, not a {kind.__name__}")
    return value


# ---- the pipeline's own steps ----------------------------------------------------------------


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


def sharpened(exc: RejectedEpisode, capture: EpisodeCapture | None) -> RejectedEpisode | None:
    """A sharper rejection than the agent's when the gateway knows why its run failed."""
    if capture is None or not exc.reason.startswith(AGENT_PREFIX):
        return None
    if capture.errors:
        return RejectedEpisode(reasons.gateway_reason(capture.errors[-1].code), exc.detail)
    run_reason = exc.reason.removeprefix(AGENT_PREFIX)
    if not capture.received and run_reason in ("model_error", "step_timeout", "timeout"):
        # The agent never got through: the advertised gateway URL is not reachable from it. A
        # call the gateway received and still held (a model-server outage longer than the
        # agent's step) is the agent's own timeout: its reason stands.
        return RejectedEpisode(Reason.GATEWAY_UNREACHABLE, exc.detail)
    return None
