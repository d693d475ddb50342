"""``agent.mode: builtin``: the rollout worker runs the agent loop itself, no agent service.

The run is the one the workflow would ask an agent service for (``RunSpec``, checked as a
``POST /runs`` body is), run by the same loop the local agent service runs
(``cua_rl.agent.loop``) inside the episode's task, and answered in the driver's shape
(``RunResult``: summary and event log), so everything after it (evaluation, rows, monitor
records, rejection reasons) is the service mode's. The model endpoint is the episode's URL on
the rollout gateway, called over loopback: the capture path of every model call is the
gateway's, whoever runs the loop. What the driver adds for a remote run maps onto this one: a
body the agent would refuse is ``create_failed``; the client deadline (``agent.driver.
deadline_s``) cancels the loop and is ``deadline``.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from cua_rl.agent.loop import AgentLoop
from cua_rl.agent.run import BadRunRequest, Run, validate_run_body
from cua_rl.agent.spec import RunResult, RunSpec, RunSummary
from cua_rl.errors import ConfigError

_IDS = itertools.count(1)


def check_model_options(model_options: dict, action_space: str) -> None:
    """``agent.model_options`` as the loop will read them; a ConfigError names what to fix.
    Checked at start, not at the first episode, since no agent service refuses them."""
    body = {
        "task": "check",
        "maxSteps": 1,
        "model": {**model_options, "baseUrl": "http://127.0.0.1/v1", "name": "check"},
        "env": {"type": "genv", "gymBaseUrl": "http://127.0.0.1", "gymId": "g", "executionId": "e"},
        "standardActionSpace": action_space,
    }
    try:
        validate_run_body(body)
    except BadRunRequest as exc:
        raise ConfigError(
            f"agent.mode=builtin runs the local agent's loop, which refuses agent.model_options "
            f"or agent.action_space: {exc} (the run's model object is agent.model_options)"
        ) from exc


async def run_builtin(loop: AgentLoop, spec: RunSpec, deadline_s: float) -> RunResult:
    """Run ``spec`` to its end (or the deadline) in this task; never raises for run failures."""
    started = time.time()
    summary = RunSummary(run_id=None, status="unknown", reason=None, started_at=started)
    run: Run | None = None
    try:
        body = validate_run_body(spec.body())
    except BadRunRequest as exc:
        summary.status, summary.reason = "failed", "create_failed"
        summary.errors.append(f"create_run: {exc}")
    else:
        run = Run(f"builtin-{int(started)}-{next(_IDS)}", body)
        summary.run_id = run.id
        try:
            async with asyncio.timeout(deadline_s):
                await loop.run(run)
        except TimeoutError:
            # The loop was cancelled mid-step (its status says "cancelled"): the deadline's.
            summary.status, summary.reason = "running", "deadline"
        else:
            summary.status, summary.reason = run.status, run.reason
    summary.ended_at = time.time()
    events = run.events if run is not None else []
    summary.read_events(events)
    return RunResult(summary=summary, events=events)
