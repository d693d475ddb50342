"""Client and run driver for gbox-mini-agent (docs/design.md, the agent).

``MiniAgentClient`` has one async method per endpoint and raises :class:`AgentError` for transport
failures and bad answers; "404 = none yet" endpoints return empty results instead. Events arrive
incrementally and overlap between polls: ``cua_rl.agent.event_log.EventLog`` de-duplicates them.

``RunDriver`` owns one run from ``POST /runs`` to a terminal status: it polls with capped
exponential backoff, treats unknown statuses as "still running", retries transient failures a
bounded number of times, and always fetches the events once more after the run ended (the last
turn would be lost otherwise). There is no cancel endpoint: when the client deadline passes the
driver returns with reason ``"deadline"`` and the caller terminates the gym execution, which stops
the box and with it the run.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from cua_rl.agent.event_log import (  # noqa: F401  (EventLog, MalformedEvent, event_key: re-exported)
    EventLog,
    MalformedEvent,
    event_key,
    event_step,
)
from cua_rl.aio import within
from cua_rl.core.fields import doc
from cua_rl.errors import AgentError, ConfigError

TERMINAL_STATUSES = frozenset({"completed", "failed"})
# Statuses seen before the end; any other non-terminal value is tolerated and recorded.
KNOWN_RUNNING = frozenset({"queued", "pending", "created", "starting", "running"})


class AgentUnreachable(AgentError):
    """No connection to the agent could be opened, so the request was never sent (an agent
    restarting or not up yet); unlike a lost answer, a retry cannot start anything twice."""


class MiniAgentClient:
    """One async method per gbox-mini-agent endpoint; inject ``client`` to share or fake transport."""

    def __init__(
        self,
        base_url: str,
        *,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = 30.0,
    ):
        if not base_url or not base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"agent base_url must be an http(s) URL such as http://127.0.0.1:8080, got {base_url!r}"
            )
        root, sep, _ = base_url.partition("/runs")
        if sep:  # a run's URL pasted instead of the service's
            raise ConfigError(f"agent base_url={base_url!r} has /runs in it: give {root}")
        self.base_url = base_url.rstrip("/")
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout_s)

    async def aclose(self) -> None:
        if self._own_client:
            await self._client.aclose()

    async def __aenter__(self) -> MiniAgentClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, *, none_on_404: bool = False, **kwargs) -> Any:
        url = f"{self.base_url}{path}"
        try:
            resp = await self._client.request(method, url, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise AgentUnreachable(
                f"{method} {path}: nothing answers at {self.base_url} ({type(exc).__name__}: "
                f"{exc}): start the agent service, or fix the host and port of agent.base_url"
            ) from exc
        except httpx.HTTPError as exc:
            raise AgentError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code == 404 and none_on_404:
            return None
        if resp.status_code >= 400:
            hint = f" (is {self.base_url} the agent service's root? check agent.base_url)"
            raise AgentError(
                f"{method} {path} answered {resp.status_code}: {resp.text[:500]}"
                + (hint if resp.status_code == 404 else ""),
                status=resp.status_code,
                body=resp.text,
            )
        try:
            return resp.json()
        except ValueError as exc:
            raise AgentError(
                f"{method} {path} answered non-JSON: {resp.text[:200]!r}",
                status=resp.status_code,
                body=resp.text,
            ) from exc

    async def create_run(self, body: dict) -> str:
        """``POST /runs``; returns the run id."""
        data = await self._request("POST", "/runs", json=body)
        run_id = data.get("runId") if isinstance(data, dict) else None
        if not run_id:
            raise AgentError(f"POST /runs answered without runId: {data!r}", status=200, body=data)
        return str(run_id)

    async def probe(self) -> None:
        """Raises ``AgentError`` unless the service answers: no health endpoint is known, so a
        lookup of a run that does not exist (a 404 is an answer) stands in for one."""
        await self._request("GET", "/runs/cua-rl-probe", none_on_404=True)

    async def get_run(self, run_id: str) -> dict:
        """``GET /runs/{id}`` -> ``{status, reason, ...}``."""
        data = await self._request("GET", f"/runs/{run_id}")
        if not isinstance(data, dict) or "status" not in data:
            raise AgentError(f"GET /runs/{run_id} answered without status: {data!r}", body=data)
        return data

    async def get_events(self, run_id: str, from_: Any = None, to: Any = None) -> list[dict]:
        """``GET /runs/{id}/events``; ``from_`` inclusive, ``to`` exclusive; [] when none yet."""
        bounds = (("from", from_), ("to", to))
        params = {name: str(value) for name, value in bounds if value is not None}
        data = await self._request("GET", f"/runs/{run_id}/events", params=params, none_on_404=True)
        if data is None:
            return []
        if isinstance(data, dict):
            data = data.get("events")
        if not isinstance(data, list):
            raise AgentError(f"events of run {run_id} are not a list: {str(data)[:200]}", body=data)
        return data

    async def get_steps(self, run_id: str) -> list[dict]:
        data = await self._request("GET", f"/runs/{run_id}/steps", none_on_404=True)
        if data is None:
            return []
        if isinstance(data, dict):
            data = data.get("steps", [])
        return list(data)

    async def get_step(self, run_id: str, index: int) -> dict | None:
        """Step ``index`` (0-based), ``None`` when it does not exist (yet)."""
        return await self._request("GET", f"/runs/{run_id}/steps/{index}", none_on_404=True)

    async def get_trajectory(self, run_id: str) -> Any:
        return await self._request("GET", f"/runs/{run_id}/trajectory", none_on_404=True)

    async def get_tokens(self, run_id: str) -> Any:
        return await self._request("GET", f"/runs/{run_id}/tokens", none_on_404=True)


def _positive(name: str, value: float | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")


@dataclass
class RunSpec:
    """What one run asks the agent to do; becomes the ``POST /runs`` body."""

    task: str = doc(help="the task instruction given to the agent")
    model_base_url: str = doc(help="OpenAI-compatible base URL ending in /v1")
    model_name: str = doc(help="served model name at model_base_url")
    gym_base_url: str = doc(help="gym server URL without /api/v1 or trailing /")
    gym_id: str = doc(help="gym id (no default is safe to assume)")
    execution_id: str = doc(help="the genv execution the agent drives")
    agent: str = doc("mai-ui", "agent flavour: mai-ui or qwen3-vl")
    max_steps: int = doc(15, "maxSteps: agent-side step limit")
    max_run_time_s: float | None = doc(None, "maxRunTimeSec: agent-side run time limit")
    max_step_time_s: float | None = doc(None, "maxStepTimeSec: agent-side limit per step")
    provider: str = doc("openai", "model provider (openai API)")
    action_space: str = doc("mobile", "standardActionSpace: mobile or pc")
    model_options: dict = doc(
        factory=dict,
        help="extra keys merged into the run's model object (e.g. logprobs, constrain)",
    )

    def __post_init__(self) -> None:
        if not self.task:
            raise ConfigError("task must be a non-empty instruction")
        if not self.model_base_url.rstrip("/").endswith("/v1"):
            raise ConfigError(
                f"model_base_url must end in /v1 (OpenAI base URL), got {self.model_base_url!r}"
            )
        if not self.gym_id:
            raise ConfigError("gym_id is required: set the gym id of the gym server")
        if not self.execution_id:
            raise ConfigError("execution_id is required: create a gym execution first")
        if self.action_space not in ("mobile", "pc"):
            raise ConfigError(f"action_space must be 'mobile' or 'pc', got {self.action_space!r}")
        if not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise ConfigError(f"max_steps must be an integer >= 1, got {self.max_steps!r}")
        _positive("max_run_time_s", self.max_run_time_s, allow_none=True)
        _positive("max_step_time_s", self.max_step_time_s, allow_none=True)

    def body(self) -> dict:
        body: dict[str, Any] = {
            "task": self.task,
            "agent": self.agent,
            "maxSteps": self.max_steps,
            "model": {
                **self.model_options,
                "baseUrl": self.model_base_url,
                "name": self.model_name,
                "provider": self.provider,
            },
            "env": {
                "type": "genv",
                "gymBaseUrl": self.gym_base_url.rstrip("/"),
                "gymId": self.gym_id,
                "executionId": self.execution_id,
            },
            "standardActionSpace": self.action_space,
        }
        if self.max_run_time_s is not None:
            body["maxRunTimeSec"] = self.max_run_time_s
        if self.max_step_time_s is not None:
            body["maxStepTimeSec"] = self.max_step_time_s
        return body


@dataclass
class DriverConfig:
    """How the client side waits for a run."""

    deadline_s: float = doc(900.0, "client deadline for the whole run, creation included")
    poll_initial_s: float = doc(0.2, "first poll interval")
    poll_max_s: float = doc(5.0, "cap of the poll interval")
    poll_factor: float = doc(1.5, "backoff multiplier per idle poll")
    max_consecutive_errors: int = doc(
        8, "failed status polls in a row tolerated before giving up (reason agent_error)"
    )
    create_connect_wait_s: float = doc(
        30.0,
        (
            "how long a run's create keeps retrying while the agent cannot be reached at "
            "all (connection refused: an agent restarting); 0 fails at once. A create whose "
            "answer was lost is never retried (it could start a second run)"
        ),
    )

    def __post_init__(self) -> None:
        _positive("deadline_s", self.deadline_s)
        _positive("poll_initial_s", self.poll_initial_s)
        if self.poll_max_s < self.poll_initial_s:
            raise ConfigError(
                f"poll_max_s ({self.poll_max_s}) must be >= poll_initial_s ({self.poll_initial_s})"
            )
        if self.poll_factor < 1.0:
            raise ConfigError(f"poll_factor must be >= 1.0, got {self.poll_factor}")
        if self.max_consecutive_errors < 0:
            raise ConfigError("max_consecutive_errors must be >= 0")
        if self.create_connect_wait_s < 0:
            raise ConfigError(
                f"create_connect_wait_s must be >= 0 (0 fails at once), got {self.create_connect_wait_s}"
            )


@dataclass
class RunSummary:
    """What became of a run, as seen by the client.

    ``reason`` is the agent's reason for terminal runs, else the driver's own:
    ``deadline`` (client deadline passed, run may still be going), ``agent_error`` (too many
    transient failures in a row), ``create_failed`` (POST /runs failed; retried only while no
    connection could be opened, ``create_retries`` counts those, since any other retry could
    start a second run on the execution), ``bad_events`` (an event broke the format).
    ``create_unavailable``: the create failed because the service is down (no connection, no
    answer in time, or a 5xx), not because it refused this run (a 4xx).
    """

    run_id: str | None
    status: str
    reason: str | None
    answer: str | None = None
    steps: int = 0
    errors: list[str] = field(default_factory=list)
    transient_errors: int = 0
    unknown_statuses: list[str] = field(default_factory=list)
    started_at: float = 0.0
    ended_at: float = 0.0
    polls: int = 0
    create_retries: int = 0
    create_unavailable: bool = False

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def duration_s(self) -> float:
        return self.ended_at - self.started_at

    def read_events(self, events: list[dict]) -> None:
        """The answer, steps and errors of the run's event log; its ``run_end`` reason when
        the summary has none of its own."""
        answer, steps, errors, end_reason = summarize_events(events)
        self.answer, self.steps = answer, steps
        self.errors = errors + self.errors
        if self.reason is None and end_reason is not None:
            self.reason = end_reason


def summarize_events(events: list[dict]) -> tuple[str | None, int, list[str], str | None]:
    """(answer, steps, error messages, run_end reason) read off an event log."""
    answer = None
    steps = 0
    errors: list[str] = []
    end_reason = None
    for ev in events:
        step = event_step(ev)
        if isinstance(step, int):
            steps = max(steps, step)
        kind = ev.get("type")
        if kind == "action_executed":
            action = ev.get("action") or {}
            if action.get("name") == "finished":
                content = (action.get("args") or {}).get("content")
                if content is not None:
                    answer = str(content)
        elif kind == "error":
            errors.append(str(ev.get("message", "")))
        elif kind == "run_end":
            end_reason = ev.get("reason")
    return answer, steps, errors, end_reason


@dataclass
class RunResult:
    summary: RunSummary
    events: list[dict]


class RunDriver:
    """Starts one run and follows it to the end or to the client deadline."""

    def __init__(self, client: MiniAgentClient, config: DriverConfig | None = None):
        self.client = client
        self.config = config or DriverConfig()

    async def run(self, spec: RunSpec) -> RunResult:
        cfg = self.config
        started = time.time()
        deadline = time.monotonic() + cfg.deadline_s
        summary = RunSummary(run_id=None, status="unknown", reason=None, started_at=started)
        log = EventLog()
        try:
            await self._drive(spec, summary, log, deadline)
        finally:
            summary.ended_at = time.time()
            summary.read_events(log.events)
        return RunResult(summary=summary, events=log.events)

    async def _drive(self, spec: RunSpec, summary: RunSummary, log: EventLog, deadline) -> None:
        cfg = self.config
        try:
            summary.run_id = await self._create(spec, summary, deadline)
        except (AgentError, TimeoutError) as exc:
            summary.status, summary.reason = "failed", "create_failed"
            summary.errors.append(f"create_run: {exc}")
            status = getattr(exc, "status", None)
            summary.create_unavailable = status is None or status >= 500
            return
        run_id = summary.run_id
        interval = cfg.poll_initial_s
        consecutive = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                summary.reason = "deadline"
                await self._final_fetch(run_id, log, summary, budget_s=2.0)
                return
            # Status and events are separate calls; either one getting through is progress, so
            # an agent that drops some connections still lets the run be followed.
            status, failures, new = None, [], 0
            try:
                status = await within(remaining, self.client.get_run(run_id))
            except (AgentError, TimeoutError) as exc:
                failures.append(exc)
            try:
                events = await within(
                    max(0.01, deadline - time.monotonic()),
                    self.client.get_events(run_id, from_=log.last_ts),
                )
                new = log.add(events)
            except MalformedEvent as exc:
                summary.reason = "bad_events"
                summary.errors.append(str(exc))
                return
            except (AgentError, TimeoutError) as exc:
                failures.append(exc)
            summary.transient_errors += len(failures)
            # Only the status call can end the run, so its failures are what is bounded: events
            # that still flow while the status keeps failing would otherwise poll to the deadline.
            if status is None:
                consecutive += 1
                if consecutive > cfg.max_consecutive_errors:
                    summary.reason = "agent_error"
                    summary.errors.append(
                        f"gave up after {consecutive} failures in a row: {failures[-1]}"
                    )
                    return
            else:
                consecutive = 0
            if status is not None:
                summary.polls += 1
                state = str(status.get("status"))
                summary.status = state
                if state in TERMINAL_STATUSES:
                    summary.reason = status.get("reason")
                    left = deadline - time.monotonic()
                    await self._final_fetch(run_id, log, summary, budget_s=max(5.0, left))
                    return
                if state not in KNOWN_RUNNING and state not in summary.unknown_statuses:
                    summary.unknown_statuses.append(state)
            # Back off while nothing happens; poll eagerly again once events flow.
            interval = (
                cfg.poll_initial_s if new else min(cfg.poll_max_s, interval * cfg.poll_factor)
            )
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))

    async def _create(self, spec: RunSpec, summary: RunSummary, deadline: float) -> str:
        # Only a create that never left this process is retried: after a lost answer the agent
        # may have started the run, and a second create would start another on the same box.
        give_up = min(deadline, time.monotonic() + self.config.create_connect_wait_s)
        delay = 0.25
        while True:
            try:
                return await within(
                    max(0.01, deadline - time.monotonic()), self.client.create_run(spec.body())
                )
            except AgentUnreachable:
                if time.monotonic() + delay > give_up:
                    raise
            summary.create_retries += 1
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)

    async def _final_fetch(
        self, run_id: str, log: EventLog, summary: RunSummary, *, budget_s: float
    ) -> None:
        # Everything, not from the last ts: cheap, and it repairs any gap left by a failed poll.
        end = time.monotonic() + budget_s
        last_exc: Exception | None = None
        for _ in range(max(1, self.config.max_consecutive_errors)):
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                log.add(await within(left, self.client.get_events(run_id)))
                return
            except (AgentError, TimeoutError) as exc:
                last_exc = exc
                summary.transient_errors += 1
                await asyncio.sleep(
                    min(self.config.poll_initial_s, max(0.0, end - time.monotonic()))
                )
        summary.errors.append(f"final event fetch failed: {last_exc}")


async def drive_run(
    base_url: str,
    spec: RunSpec,
    *,
    config: DriverConfig | None = None,
    client: httpx.AsyncClient | None = None,
) -> RunResult:
    """Convenience: one client, one driver, one run."""
    async with MiniAgentClient(base_url, client=client) as agent:
        return await RunDriver(agent, config).run(spec)
