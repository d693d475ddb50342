"""``agent.mode: function``: an agent of the user's own, a Python callable run in the rollout worker.

The config names it (``agent.function: "package.module:callable"``, imported when the config
loads, so a bad path is a ``config error:`` line). Each episode calls it once with one
``AgentEpisode``: the task as the gym gave it, the episode's model endpoint (its URL on the rollout
gateway, the served name, an api key: any string works) and the box, the gym execution with
``screenshot()`` and ``act(action)``. Whatever OpenAI-compatible client the function uses (the
``openai`` SDK, LangChain, ...), its calls to ``model.base_url`` are the gateway's: captured,
sampled with the trainer's settings, held through weight updates and trained as any agent's. An
async callable runs in the episode's task; a plain one in a thread of its own, with a box whose
methods block.

The run answers in the driver's shape (``RunResult``) with gbox-mini-agent's events, built when it
ends (``run_events``) from what the box saw (each screenshot and action, with the number of model
calls the gateway had captured when it came) and the calls themselves. A step is the agent
loop's (look, ask, act): a screenshot after calls or actions begins one, and so do calls after an
action. So evaluation, rows, the monitor's turns, actions and screenshots, and rejection reasons
are the other modes'. What goes wrong ends the run
with a reason (the episode's rejection is ``agent_<reason>``): ``function_error`` (it raised; the
exception and the task are in the detail, the traceback in the log), ``env_error`` (a box call
failed and the function let the error out), ``deadline`` (the nearer of ``agent.max_run_time_s``
and ``agent.driver.deadline_s`` passed: the function is cancelled), ``no_model_call`` (it returned
without a model call through ``model.base_url``: nothing to train).

A thread cannot be cancelled: at the deadline the episode goes on without it, its box and its
model URL close with the episode, and the function's next call to either fails, which ends it.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import inspect
import itertools
import json
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from cua_rl.agent.actions import event_args_of_gym_action
from cua_rl.agent.run import iso
from cua_rl.agent.spec import RunResult, RunSpec, RunSummary
from cua_rl.clients.genv import GenvClient
from cua_rl.errors import ConfigError, GymError
from cua_rl.logs import get_logger

log = get_logger(__name__)

# What the episode's model endpoint takes as a key: the gateway reads none, SDKs want one.
API_KEY = "cua-rl"
# How long a cancelled async function may take to end before the episode goes on without it.
CANCEL_GRACE_S = 5.0
_IDS = itertools.count(1)


# ---- the callable ------------------------------------------------------------------------------


def load_agent_function(path: str) -> Callable[..., Any]:
    """The callable ``path`` names (``package.module:callable``, attributes dotted after the
    colon); a ConfigError naming the module and the callable says what is wrong."""
    module_name, sep, attr = (path or "").partition(":")
    if not sep or not module_name.strip() or not attr.strip():
        raise ConfigError(
            f"agent.function={path!r} must name a callable as 'package.module:callable', e.g. "
            "agent.function=examples.cua_agent.openai_agent:run"
        )
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # the module's own import error is what the user must see
        raise ConfigError(
            f"agent.function={path!r}: module {module_name!r} cannot be imported "
            f"({type(exc).__name__}: {exc}); it must be importable by the trainer and the rollout "
            "workers (run from the folder that holds it, or install it)"
        ) from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(
                f"agent.function={path!r}: module {module_name!r} has no {attr!r}"
            ) from None
    if not callable(target):
        raise ConfigError(
            f"agent.function={path!r}: {attr!r} in module {module_name!r} is a "
            f"{type(target).__name__}, not a callable"
        )
    return target


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` gives a coroutine (an ``async def``, or an object whose
    ``__call__`` is one); anything else runs in a thread."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (a callable object's own __call__)
    )


def describe(path: str) -> str:
    """``path`` and how it will run: the ``--check`` line's detail."""
    fn = load_agent_function(path)
    kind = "async, run in the episode's task" if is_async(fn) else "sync, run in a thread"
    return f"function {path} ({kind}): the rollout workers call it once per episode"


# ---- what the callable gets ----------------------------------------------------------------------


@dataclass(frozen=True)
class AgentTask:
    """The episode's task as the gym gave it: its id, its instruction, the whole task row."""

    id: str
    instruction: str
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentModel:
    """The episode's OpenAI endpoint: ``base_url`` ends in ``/v1``; any ``api_key`` works."""

    base_url: str
    name: str
    api_key: str = API_KEY


@dataclass(frozen=True)
class Screenshot:
    """The box's screen: PNG bytes and size in pixels; ``url`` the gym's, when it gives one."""

    png: bytes
    width: int
    height: int
    url: str | None = None

    @property
    def data_url(self) -> str:
        """The PNG as a data URL, for an ``image_url`` part of a chat message."""
        return "data:image/png;base64," + base64.b64encode(self.png).decode()


class RunEnded(RuntimeError):
    """The episode is over (its deadline passed, or it was cancelled): the box takes no call."""


@dataclass
class BoxCall:
    """One call the function made on the box, as the run's events are built from it."""

    kind: str  # "screenshot" or "act"
    calls: int  # model calls the gateway had captured when it came
    started: float
    ended: float
    action: dict | None = None
    result: dict | None = None


class Box:
    """The episode's gym execution (``await box.screenshot()``, ``await box.act(action)``), and
    the record of what the function did with it."""

    def __init__(
        self,
        gym: GenvClient,
        execution_id: str,
        model_calls: Callable[[], int],
        http: httpx.AsyncClient,
    ):
        self.execution_id = execution_id
        self._gym, self._http, self._model_calls = gym, http, model_calls
        self.log: list[BoxCall] = []
        self.gym_error: GymError | None = None
        self.closed = False

    async def screenshot(self) -> Screenshot:
        """The screen now."""
        call = self._begin("screenshot")
        shot = await self._gym_call(self._gym.screenshot(self.execution_id))
        png = await self._png(shot)
        self._end(call)
        url = shot.get("url") if isinstance(shot.get("url"), str) else None
        return Screenshot(png, int(shot["width"]), int(shot["height"]), url)

    async def act(self, action: dict) -> dict:
        """Run one gym action (``{"name": "tap", "args": {"x": 120, "y": 300}}``, docs/agent.md's
        action language); the gym's answer. A refused action answers ``ok: false`` with the
        gym's error and the episode goes on."""
        if not isinstance(action, dict) or not isinstance(action.get("name"), str):
            raise TypeError(f"box.act takes the gym's action {{name, args}}, got {action!r}")
        call = self._begin("act", action=dict(action))
        call.result = await self._gym_call(self._gym.act(self.execution_id, action))
        self._end(call)
        return call.result

    def _begin(self, kind: str, **fields: Any) -> BoxCall:
        if self.closed:
            raise RunEnded(f"the episode of execution {self.execution_id} is over")
        now = time.time()
        return BoxCall(kind, self._model_calls(), now, now, **fields)

    def _end(self, call: BoxCall) -> None:
        call.ended = time.time()
        self.log.append(call)

    async def _gym_call(self, call: Awaitable[dict]) -> dict:
        try:
            return await call
        except GymError as exc:
            self.gym_error = exc
            raise

    async def _png(self, shot: dict) -> bytes:
        data_url = shot.get("data_url")
        if isinstance(data_url, str) and data_url.startswith("data:") and "," in data_url:
            return base64.b64decode(data_url.split(",", 1)[1])
        url = shot.get("url")
        if not isinstance(url, str) or not url:
            raise GymError("the gym's screenshot has neither data_url nor url", body=shot)
        try:
            resp = await self._http.get(url)
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            self.gym_error = GymError(f"screenshot {url}: {type(exc).__name__}: {exc}")
            raise self.gym_error from exc
        return resp.content


class BlockingBox:
    """The box of a sync function (run in its own thread): the same methods, blocking, each run
    on the episode's event loop."""

    def __init__(self, box: Box, loop: asyncio.AbstractEventLoop):
        self._box, self._loop = box, loop
        self.execution_id = box.execution_id

    def screenshot(self) -> Screenshot:
        return self._run(self._box.screenshot())

    def act(self, action: dict) -> dict:
        return self._run(self._box.act(action))

    def _run(self, coro):
        if self._box.closed:
            coro.close()
            raise RunEnded(f"the episode of execution {self._box.execution_id} is over")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


@dataclass(frozen=True)
class AgentEpisode:
    """What the agent function is called with: ``task``, ``model``, ``box``; ``max_steps`` is
    ``agent.max_steps`` (the function keeps to it: nothing counts its steps) and
    ``action_space`` ``agent.action_space`` (mobile or pc)."""

    task: AgentTask
    model: AgentModel
    box: Box | BlockingBox
    max_steps: int
    action_space: str


# ---- the run -----------------------------------------------------------------------------------


@dataclass
class FunctionRun:
    """What one run needs besides its ``RunSpec``: the callable and its path, the task, the gym
    client, the live count and list of the episode's captured model calls."""

    fn: Callable[..., Any]
    path: str
    task: AgentTask
    gym: GenvClient
    http: httpx.AsyncClient
    captured: Callable[[], Sequence[Any]]


async def run_function(run: FunctionRun, spec: RunSpec, deadline_s: float) -> RunResult:
    """Call the agent function to its end, or its deadline; never raises for the function's
    failures (a cancelled episode cancels the function and raises)."""
    started = time.time()
    summary = RunSummary(
        run_id=f"function-{int(started)}-{next(_IDS)}",
        status="failed",
        reason=None,
        started_at=started,
    )
    box = Box(run.gym, spec.execution_id, lambda: len(run.captured()), run.http)
    sync = not is_async(run.fn)
    episode = AgentEpisode(
        task=run.task,
        model=AgentModel(spec.model_base_url, spec.model_name),
        box=BlockingBox(box, asyncio.get_running_loop()) if sync else box,
        max_steps=spec.max_steps,
        action_space=spec.action_space,
    )
    limit, bound = _limit(spec, deadline_s)
    task = asyncio.ensure_future(_call_in_thread(run, episode) if sync else run.fn(episode))
    answer, errors = None, []
    try:
        done, _ = await asyncio.wait({task}, timeout=limit)
    except asyncio.CancelledError:
        box.closed = True
        task.cancel()
        raise
    box.closed = True
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        # One reason for either bound (the detail names which): an agent_timeout with no model
        # call would read as an agent service that cannot reach the gateway.
        summary.reason = "deadline"
        if sync:
            fate = "the episode goes on without it; its thread ends at its next box or model call"
        else:
            fate = "cancelled" if task.done() else "cancelled, and it ignored the cancellation"
        errors.append(
            f"agent function {run.path} on task {run.task.id} ran past {bound}={limit:g}s: {fate}"
        )
    elif (exc := task.exception()) is not None:
        gym = box.gym_error is not None and _caused_by(exc, box.gym_error)
        summary.reason = "env_error" if gym else "function_error"
        errors.append(
            f"agent function {run.path} raised {type(exc).__name__}: {exc} on task {run.task.id}"
        )
        log.warning(
            "agent function %s raised on task %s:\n%s",
            run.path,
            run.task.id,
            "".join(traceback.format_exception(exc)),
        )
    else:
        result = task.result()
        answer = None if result is None else str(result)
        if not run.captured():
            summary.reason = "no_model_call"
            errors.append(
                f"agent function {run.path} returned on task {run.task.id} without calling the "
                f"model at its model.base_url ({spec.model_base_url}): nothing to train"
            )
        else:
            summary.status, summary.reason = "completed", "finished"
    summary.ended_at = time.time()
    events = run_events(
        box.log, run.captured(), answer, errors, summary.reason, started, summary.ended_at
    )
    summary.read_events(events)
    return RunResult(summary=summary, events=events)


def _limit(spec: RunSpec, deadline_s: float) -> tuple[float, str]:
    """The run's time bound and the setting it comes from (the nearer of the two)."""
    if spec.max_run_time_s is not None and spec.max_run_time_s <= deadline_s:
        return spec.max_run_time_s, "agent.max_run_time_s"
    return deadline_s, "agent.driver.deadline_s"


def _caused_by(exc: BaseException, cause: BaseException) -> bool:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if exc is cause:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


async def _call_in_thread(run: FunctionRun, episode: AgentEpisode) -> Any:
    """The sync function in a thread of its own (not the loop's default executor, whose few
    threads a hung agent would hold away from the row builder)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def target() -> None:
        try:
            value, ok = run.fn(episode), True
        except BaseException as exc:  # handed to the episode, whatever it is
            value, ok = exc, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop is gone: nobody waits for this run any more
            pass

    threading.Thread(target=target, name=f"cua-agent-{run.task.id}", daemon=True).start()
    return await future


# ---- the run's events ----------------------------------------------------------------------------


class _Clock:
    """Event timestamps in epoch ms, strictly increasing (the event log's de-duplication key
    holds the timestamp)."""

    def __init__(self):
        self.last = 0

    def ts(self, seconds: float) -> str:
        ms = max(int(seconds * 1000), self.last + 1)
        self.last = ms
        return iso(ms)


@dataclass
class _Step:
    start: float
    end: float
    calls: list = field(default_factory=list)
    acts: list[BoxCall] = field(default_factory=list)


def _steps(
    log: Sequence[BoxCall], calls: Sequence[Any], answer: str | None, started: float, ended: float
) -> list[_Step]:
    """The run's steps, as the agent loop's are (look, ask, act): a screenshot after calls or
    actions begins a step, and so do calls after an action; a step's calls are those the
    gateway captured before its actions. The answer becomes the last step's ``finished``
    action (``run_events``)."""
    steps = [_Step(started, started)]
    consumed = 0

    def close(at: float) -> _Step:
        """End the step (at its last action, else at ``at``) and begin the next."""
        if not steps[-1].acts:
            steps[-1].end = max(steps[-1].end, at)
        steps.append(_Step(steps[-1].end, steps[-1].end))
        return steps[-1]

    def take(upto: int, at: float) -> None:
        nonlocal consumed
        new = list(calls[consumed:upto])
        consumed = max(consumed, upto)
        if new and steps[-1].acts:
            close(at)
        steps[-1].calls.extend(new)

    for call in log:
        take(call.calls, call.started)
        if call.kind == "act":
            steps[-1].acts.append(call)
            steps[-1].end = call.ended
        elif steps[-1].calls or steps[-1].acts:
            close(call.started).start = call.started
    take(len(calls), ended)
    if not steps[-1].acts:
        steps[-1].end = ended
    steps = [s for s in steps if s.calls or s.acts]
    if answer is not None and not steps:
        steps.append(_Step(started, ended))
    return steps


def _event_action(act: BoxCall, step: int, index: int) -> dict:
    action = act.action or {}
    return {
        "name": str(action.get("name")),
        "args": event_args_of_gym_action(action),
        "callId": f"call-{step}-{index}",
        "rawFeedback": json.dumps(action, sort_keys=True, default=str),
        "rawResult": act.result,
    }


def _model_output(call: Any) -> dict:
    return {
        "id": call.response_id,
        "object": "chat.completion",
        "choices": [{"index": 0, "message": call.message, "finish_reason": call.finish_reason}],
    }


def run_events(
    log: Sequence[BoxCall],
    calls: Sequence[Any],
    answer: str | None,
    errors: Sequence[str],
    reason: str | None,
    started: float,
    ended: float,
) -> list[dict]:
    """gbox-mini-agent's events of a function's run: per step ``step_start``, a ``model_call`` /
    ``model_output`` pair per captured call (the answer as the agent got it, by its response id),
    an ``action_executed`` per box action, ``step_end``; the answer as a ``finished`` action of
    the last step; ``error`` events; ``run_end``. Pure: ``calls`` are the gateway's captured
    turns (``response_id``, ``message``, ``finish_reason``, ``seconds``)."""
    clock = _Clock()
    events: list[dict] = []

    def emit(kind: str, step: int, when: float, **fields: Any) -> None:
        events.append({"type": kind, "ts": clock.ts(when), "step": step, **fields})

    steps = _steps(log, calls, answer, started, ended)
    for n, step in enumerate(steps, 1):
        emit("step_start", n, step.start)
        asked = step.acts[0].started if step.acts else step.end
        for call in step.calls:
            emit("model_call", n, asked)
            emit("model_output", n, asked, modelOutput=_model_output(call),
                 durationMs=int(getattr(call, "seconds", 0.0) * 1000))  # fmt: skip
        for i, act in enumerate(step.acts):
            emit("action_executed", n, act.ended, action=_event_action(act, n, i), actionIndex=i,
                 startTs=iso(int(act.started * 1000)), endTs=iso(int(act.ended * 1000)),
                 durationMs=int((act.ended - act.started) * 1000))  # fmt: skip
        if answer is not None and n == len(steps):
            finished = {"name": "finished", "args": {"content": answer},
                        "callId": f"call-{n}-{len(step.acts)}", "rawFeedback": answer,
                        "rawResult": {"ok": True, "error": None}}  # fmt: skip
            emit("action_executed", n, step.end, action=finished, actionIndex=len(step.acts))
        emit("step_end", n, step.end)
    last = max(len(steps), 1)
    for message in errors:
        emit("error", last, ended, message=message)
    emit("run_end", last, ended, ok=reason == "finished", reason=reason)
    return events
