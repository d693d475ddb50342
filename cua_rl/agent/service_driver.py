"""A run on the agent service (gbox-mini-agent), driven from ``POST /runs`` to its end.

``RunDriver`` owns one run: it creates it (a create is retried only while no connection could be
opened: any other retry could start a second run on the box), polls with capped exponential
backoff, treats unknown statuses as "still running", retries transient failures a bounded number
of times, and always fetches the events once more after the run ended (the last turn would be
lost otherwise). Events overlap between polls: ``cua_rl.agent.event_log.EventLog`` de-duplicates
them. There is no cancel endpoint: when the client deadline passes the driver returns with reason
``"deadline"`` and the caller terminates the gym execution, which stops the box and with it the
run.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from cua_rl.agent.event_log import EventLog, MalformedEvent
from cua_rl.agent.spec import TERMINAL_STATUSES, RunResult, RunSpec, RunSummary, check_positive
from cua_rl.aio import within
from cua_rl.clients.gbox_mini_agent import AgentUnreachable, MiniAgentClient
from cua_rl.core.fields import doc
from cua_rl.errors import AgentError, ConfigError

# Statuses seen before the end; any other non-terminal value is tolerated and recorded.
KNOWN_RUNNING = frozenset({"queued", "pending", "created", "starting", "running"})


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
        check_positive("deadline_s", self.deadline_s)
        check_positive("poll_initial_s", self.poll_initial_s)
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
