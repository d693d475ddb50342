"""One agent run's state, and the checks of a run body (``POST /runs`` or the builtin mode's) and of event time bounds.

A finished run's record (events, steps, tokens) can be moved to disk (``Run.spill``): its model
calls' events hold every screenshot of the prompt as a data URL and every prompt token id, and
a service keeping hundreds of finished runs readable grew by all of it. Spilled, the same
attributes read it back from the file, unchanged.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from typing import Any

from cua_rl.agent.actions import ACTION_NAMES
from cua_rl.agent.context import POLICIES
from cua_rl.agent.flavours import FLAVOUR_NAMES
from cua_rl.core.spill import Spill, Spilled


class BadRunRequest(ValueError):
    """A POST /runs body the agent cannot run; answered with 400 and this message."""


class EndRun(Exception):
    """Ends a run with a reason (run_end / GET /runs/{id})."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.") + (
        f"{ms % 1000:03d}Z"
    )


def parse_time(value: str) -> int:
    """An events ``from`` / ``to`` bound (epoch ms or ISO 8601) as epoch ms."""
    value = value.strip()
    try:
        return int(float(value))
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise BadRunRequest(f"time bound {value!r} is neither epoch ms nor ISO 8601") from exc
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(round(dt.timestamp() * 1000))


def validate_run_body(body: Any) -> dict:
    """Checks a POST /runs body; raises BadRunRequest naming the field to fix."""
    if not isinstance(body, dict):
        raise BadRunRequest("body must be a JSON object")
    if not isinstance(body.get("task"), str) or not body["task"].strip():
        raise BadRunRequest("task must be a non-empty string")
    max_steps = body.get("maxSteps")
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
        raise BadRunRequest(f"maxSteps must be an integer >= 1, got {max_steps!r}")
    for name in ("maxRunTimeSec", "maxStepTimeSec"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int | float) or value <= 0):
            raise BadRunRequest(f"{name} must be a positive number, got {value!r}")
    model = body.get("model")
    if not isinstance(model, dict) or not model.get("baseUrl") or not model.get("name"):
        raise BadRunRequest("model must be {baseUrl, name, provider}")
    if model.get("provider", "openai") != "openai":
        raise BadRunRequest(f"only provider 'openai' is supported, got {model.get('provider')!r}")
    if model.get("imageMode", "data") not in ("data", "url"):
        raise BadRunRequest("model.imageMode must be 'data' or 'url'")
    if model.get("constrain") not in (None, False, "regex", "ascii"):
        raise BadRunRequest("model.constrain must be 'regex', 'ascii' or absent")
    if model.get("flavour", "sim") not in FLAVOUR_NAMES:
        raise BadRunRequest(f"model.flavour must be one of {list(FLAVOUR_NAMES)}")
    if model.get("flavour", "sim") != "sim" and model.get("constrain") == "regex":
        raise BadRunRequest("model.constrain=regex constrains the sim flavour's language only")
    tools = model.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise BadRunRequest("model.tools must be a list of function objects")
    if model.get("context") is not None and model["context"] not in POLICIES:
        raise BadRunRequest(f"model.context must be one of {list(POLICIES)}")
    history_n = model.get("historyN")
    if history_n is not None and (
        not isinstance(history_n, int) or isinstance(history_n, bool) or history_n < 1
    ):
        raise BadRunRequest(f"model.historyN must be an integer >= 1, got {history_n!r}")
    if model.get("parse", "strict") not in ("strict", "lenient"):
        raise BadRunRequest("model.parse must be 'strict' or 'lenient'")
    grid = model.get("lenientGrid")
    if grid is not None and (not isinstance(grid, int) or isinstance(grid, bool) or grid < 1):
        raise BadRunRequest(
            f"model.lenientGrid must be an integer >= 1 (cells per side), got {grid!r}"
        )
    actions = model.get("actions")
    if actions is not None and (
        not isinstance(actions, list) or not actions or any(a not in ACTION_NAMES for a in actions)
    ):
        raise BadRunRequest(f"model.actions must be a non-empty subset of {list(ACTION_NAMES)}")
    env = body.get("env")
    if not isinstance(env, dict) or env.get("type") != "genv":
        raise BadRunRequest("env must be {type: 'genv', gymBaseUrl, gymId, executionId}")
    for key in ("gymBaseUrl", "gymId", "executionId"):
        if not env.get(key):
            raise BadRunRequest(f"env.{key} is required")
    if body.get("standardActionSpace", "mobile") not in ("mobile", "pc"):
        raise BadRunRequest("standardActionSpace must be 'mobile' or 'pc'")
    return body


class Run:
    """State of one run; events are appended only by the run's own task."""

    def __init__(self, run_id: str, body: dict):
        self.id = run_id
        self.body = body
        self.status = "queued"
        self.reason: str | None = None
        self._events: list[dict] = []
        self._event_ms: list[int] = []
        self._steps: list[dict] = []
        self._tokens: list[dict] = []
        self.created_at = time.time()
        self.task: asyncio.Task | None = None
        self._last_ms = 0
        self.spilled: Spilled | None = None

    # The record's parts, in the order ``spill`` writes them.
    _PARTS = ("_events", "_event_ms", "_steps", "_tokens")

    def _part(self, name: str) -> list:
        if self.spilled is None:
            return getattr(self, name)
        return json.loads(Spill.read(self.spilled, self._PARTS.index(name)))

    @property
    def events(self) -> list[dict]:
        return self._part("_events")

    @property
    def steps(self) -> list[dict]:
        return self._part("_steps")

    @property
    def tokens(self) -> list[dict]:
        return self._part("_tokens")

    def spill(self, spill: Spill) -> Spilled:
        """Move the record of this finished run to ``spill``'s disk (``OSError`` leaves it in
        memory); afterwards every read comes from the file."""
        if self.task is not None and not self.task.done():
            raise RuntimeError(f"run {self.id} is still running; only a finished run spills")
        parts = [json.dumps(getattr(self, name)).encode() for name in self._PARTS]
        self.spilled = spill.write(parts)
        for name in self._PARTS:
            setattr(self, name, [])
        return self.spilled

    def emit(self, type_: str, step: int, **fields) -> dict:
        # Strictly increasing ms timestamps keep (type, ts, step, actionIndex) unique.
        ms = max(int(time.time() * 1000), self._last_ms + 1)
        self._last_ms = ms
        event = {"type": type_, "ts": iso(ms), "step": step, **fields}
        self._events.append(event)
        self._event_ms.append(ms)
        return event

    def events_between(self, from_ms: int | None, to_ms: int | None) -> list[dict]:
        return [
            ev
            for ev, ms in zip(self.events, self._part("_event_ms"), strict=True)
            if (from_ms is None or ms >= from_ms) and (to_ms is None or ms < to_ms)
        ]
