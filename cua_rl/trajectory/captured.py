"""What the gateway captured of an episode, as the row builder's turns and the monitor's.

The gateway keeps, per model call the agent made (``cua_rl.gateway.capture``), the ids the model
saw and sampled, their logprobs, the version that sampled each token and the images as the model
received them; the agent's event log keeps the actions. ``row_turns`` joins the two into the
``Turn``s ``convert_turns`` builds rows from (token data as captured, actions from the events);
``monitor_turns`` gives the agent's turns with the captured token data, for the monitor. A call
matches its event turn by the response id the gateway gave the reply, or by position when the
events carry none. Pure: only the capture's fields are read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cua_rl.trajectory.events import Turn

IMAGE_KEY_PREFIX = "sha256:"


def image_keys(call: Any) -> list[str]:
    """The keys a call's images go by in its turn and in ``images``."""
    return [IMAGE_KEY_PREFIX + img.sha256 for img in call.images]


def images(capture: Any) -> dict[str, bytes]:
    """Every image of the episode by the key its turns use (what ``iter_images`` reads)."""
    return {IMAGE_KEY_PREFIX + img.sha256: img.data for t in capture.turns for img in t.images}


def call_notes(call: Any) -> dict[str, Any]:
    """What a turn notes of its call: versions, sampling settings the trainer replaced, aborts,
    re-sends, a dropped vision token, the tools (their schema where they first reached the
    prompt) and the tool calls parsed from the reply."""
    notes: dict[str, Any] = {"versions": sorted(set(call.versions))}
    if call.overridden:
        notes["sampling_overridden"] = call.overridden
    for key in ("aborts", "retries", "cut"):
        if getattr(call, key):
            notes[key] = getattr(call, key)
    if call.tools:
        notes["tools"] = [t["function"]["name"] for t in call.tools]
        if call.tools_first_seen:
            notes["tools_schema"] = call.tools
    if tool_calls := call.message.get("tool_calls"):
        notes["tool_calls"] = [c["function"]["name"] for c in tool_calls]
    return notes


def token_fields(call: Any) -> dict[str, Any]:
    """What the capture knows better than the agent's event log: a ``Turn``'s token data."""
    return {
        "prompt_ids": list(call.prompt_ids),
        "output_ids": list(call.output_ids),
        "output_logprobs": list(call.logprobs),
        "output_versions": list(call.versions),
        "finish_reason": call.finish_reason,
        "image_urls": image_keys(call),
        "notes": call_notes(call),
    }


def matches(capture: Any, event_turns: list[Turn]) -> list[tuple[Any, Turn | None]]:
    """Each captured call with the agent's turn for it, if any."""
    by_id = {t.response_id: t for t in event_turns if t.response_id}
    if by_id:
        return [(c, by_id.get(c.response_id)) for c in capture.turns]
    aligned = len(event_turns) == len(capture.turns)
    return [(c, event_turns[c.index] if aligned else None) for c in capture.turns]


def row_turns(capture: Any, event_turns: list[Turn]) -> list[Turn]:
    """The row builder's turns: tokens, logprobs, versions and images as captured; actions from
    the agent's events (the only place actions live)."""
    out: list[Turn] = []
    for c, ev in matches(capture, event_turns):
        out.append(
            Turn(
                step=ev.step if ev else c.index + 1,
                index=c.index,
                messages=None,
                text=c.text,
                actions=list(ev.actions) if ev else [],
                action_parsed=ev.action_parsed if ev else False,
                action_ok=ev.action_ok if ev else False,
                response_id=c.response_id,
                **token_fields(c),
            )
        )
    return out


def monitor_turns(capture: Any, event_turns: list[Turn]) -> list[Turn]:
    """The agent's turns with the token data the gateway captured for them."""
    captured = {id(ev): c for c, ev in matches(capture, event_turns) if ev is not None}
    out = []
    for ev in event_turns:
        c = captured.get(id(ev))
        out.append(ev if c is None else replace(ev, missing=None, **token_fields(c)))
    return out
