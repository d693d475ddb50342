"""Which training, step, eval or baseline the current code runs under, in contextvars.

Set once where the trainer enters a step / eval / baseline (``with monitor_context(step_id=...)``);
every coroutine started inside inherits it, so the rollout recorder finds its source without
threading ids through the workflow. An id is a server id (int) or a client id (str: the run name
for a training, ``step-{training_id}-{step}-{batch}`` for a step, ...); the server resolves both.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar, Token
from dataclasses import dataclass, replace
from typing import Any

Ref = int | str | None


@dataclass(frozen=True)
class MonitorContext:
    training_id: Ref = None
    step_id: Ref = None
    eval_id: Ref = None
    baseline_id: Ref = None

    def source(self) -> tuple[str, int | str] | None:
        """The rollout source: the innermost of eval, baseline, step that is set."""
        for kind in ("eval", "baseline", "step"):
            value = getattr(self, f"{kind}_id")
            if value is not None:
                return kind, value
        return None


# MonitorContext is frozen, so sharing one default instance is safe.
_CURRENT: ContextVar[MonitorContext] = ContextVar(
    "cua_rl_monitor_context",
    default=MonitorContext(),  # noqa: B039
)


def current() -> MonitorContext:
    return _CURRENT.get()


def set_context(**changes: Ref) -> Token:
    """Replace some ids in the current context; returns the token for ``reset_context``."""
    return _CURRENT.set(replace(_CURRENT.get(), **changes))


def reset_context(token: Token) -> None:
    _CURRENT.reset(token)


@contextlib.contextmanager
def monitor_context(**changes: Ref):
    """``with monitor_context(step_id=...):`` scopes the ids to the block (and its tasks)."""
    token = set_context(**changes)
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def ref_field(name: str, value: Any) -> dict[str, Any]:
    """``{"step_id": 3}`` for a server id, ``{"step_client_id": "step-1-3-0"}`` for a client id."""
    if value is None:
        return {}
    if isinstance(value, int) and not isinstance(value, bool):
        return {f"{name}_id": value}
    return {f"{name}_client_id": str(value)}
