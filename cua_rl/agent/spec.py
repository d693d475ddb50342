"""An agent run as an episode asks for it and as it came back, whoever runs it.

``RunSpec`` is the run an episode asks for (it becomes gbox-mini-agent's ``POST /runs`` body, and
the built-in loop checks the same body); ``RunSummary`` and ``RunResult`` are what became of it:
status, reason, answer, steps, errors and the event log, read the same way whether the run went
to the agent service (``cua_rl.agent.service_driver``) or ran in the rollout worker
(``cua_rl.agent.builtin``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cua_rl.agent.event_log import event_step
from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError

TERMINAL_STATUSES = frozenset({"completed", "failed"})


def check_positive(name: str, value: float | None, *, allow_none: bool = False) -> None:
    """Raise ConfigError unless ``value`` is a positive number (or None where allowed)."""
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
        check_positive("max_run_time_s", self.max_run_time_s, allow_none=True)
        check_positive("max_step_time_s", self.max_step_time_s, allow_none=True)

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
