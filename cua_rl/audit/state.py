"""Did an action change the device's state? The one definition the audit and training share.

The local gym compares the device's state before and after each action (the phone's whole state
object; a MiniWoB page's task area, form values, focus, scroll offsets and reward globals) and
answers ``changed: true|false`` beside the action's ``ok`` (``cua_rl/sim/device.py``). The agent
loop keeps that answer as the action's ``rawResult``, so an agent run's events carry it.

One action's effect is ``changed`` or ``unchanged`` when the gym said so, ``unchanged`` when the
action never reached the device (``finished``, a reply that did not parse, a question to the
user, an MCP call, an action the gym refused with 400), and ``unknown`` otherwise: a gym that
does not report it (the production genv, gbox-mini-agent's own results) is never counted as
either. An episode changed the state when one of its actions did; it did not when every action
is known not to have (an episode of no action at all included); otherwise it is ``unknown``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

CHANGED, UNCHANGED, UNKNOWN = "changed", "unchanged", "unknown"
EFFECTS = (CHANGED, UNCHANGED, UNKNOWN)
# Actions of the agent's language that never reach the device.
NOT_SENT = frozenset({"finished", "invalid", "ask_user", "mcp_call"})


def action_effect(name: Any, result: Any) -> str:
    """One action's effect from its name and its result (the gym's answer, or the loop's)."""
    if name in NOT_SENT:
        return UNCHANGED
    if isinstance(result, Mapping):
        if result.get("status") == 400:  # refused: the device never ran it
            return UNCHANGED
        changed = result.get("changed")
        if isinstance(changed, bool):
            return CHANGED if changed else UNCHANGED
    return UNKNOWN


def episode_effect(effects: Iterable[str]) -> str:
    """An episode's effect from its actions' (none at all: unchanged)."""
    seen = set(effects)
    if CHANGED in seen:
        return CHANGED
    return UNKNOWN if UNKNOWN in seen else UNCHANGED


def run_effect(events: Iterable[Any]) -> str:
    """The effect of an agent run from its events (gbox-mini-agent's ``action_executed``)."""
    effects = []
    for event in events:
        if not isinstance(event, Mapping) or event.get("type") != "action_executed":
            continue
        action = event.get("action")
        if not isinstance(action, Mapping):
            effects.append(UNKNOWN)
            continue
        effects.append(action_effect(action.get("name"), action.get("rawResult")))
    return episode_effect(effects)


def rewarded(score: float | None, success: bool | None) -> bool:
    """Whether a verdict rewards: a positive score, or success where there is no score."""
    if score is not None:
        return score > 0 or success is True
    return success is True
