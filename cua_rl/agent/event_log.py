"""The agent's event log as a run's polls deliver it: overlapping pages, de-duplicated.

Events arrive incrementally and overlap between polls (``from`` is inclusive), so ``EventLog``
de-duplicates on ``(type, ts, step, actionIndex)`` and keeps the server's order; an event that
breaks the format is a :class:`MalformedEvent` (not transient: the driver does not retry it).
"""

from __future__ import annotations

from typing import Any

from cua_rl.errors import AgentError


class MalformedEvent(AgentError):
    """The agent sent an event that breaks the event format (not transient: no retry)."""


def event_step(event: dict) -> Any:
    # Older servers number turns instead of steps.
    return event.get("step", event.get("turn"))


def event_key(event: dict) -> tuple:
    """The identity of an event across overlapping fetches."""
    return (event.get("type"), event.get("ts"), event_step(event), event.get("actionIndex"))


class EventLog:
    """Append-only, de-duplicated event list in the order the server delivered them."""

    def __init__(self) -> None:
        self._events: list[dict] = []
        self._seen: set[tuple] = set()

    def add(self, events: list[dict]) -> int:
        """Add what is new; returns how many events were new."""
        added = 0
        for event in events:
            if not isinstance(event, dict) or "type" not in event:
                raise MalformedEvent(f"malformed event (expected an object with 'type'): {event!r}")
            key = event_key(event)
            try:
                if key in self._seen:
                    continue
                self._seen.add(key)
            except TypeError as exc:  # unhashable ts/step: the server broke the format
                raise MalformedEvent(f"malformed event key {key!r}: {exc}") from exc
            self._events.append(event)
            added += 1
        return added

    @property
    def events(self) -> list[dict]:
        return list(self._events)

    @property
    def last_ts(self) -> Any:
        return self._events[-1].get("ts") if self._events else None

    def __len__(self) -> int:
        return len(self._events)
