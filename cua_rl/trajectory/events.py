"""Agent event log -> turns: one :class:`Turn` per model call, with exactly what was sampled.

The agent's event log (docs/design.md, the agent) interleaves ``model_call`` (the OpenAI request),
``model_output`` (the whole chat-completion response) and ``action_executed`` events, each with a
1-based ``step``. A turn pairs the n-th call of a step with the n-th output of the same step and
takes its token data from vLLM's fields only: top-level ``prompt_token_ids``,
``choices[0].token_ids`` and ``choices[0].logprobs.content[i].logprob`` (token strings are never
read: they can be empty for partial UTF-8). Missing token data is recorded on the turn
(``missing``) rather than guessed; the row builder applies the configured policy.

Pure: no I/O. Malformed input raises :class:`~cua_rl.errors.RejectedEpisode` with a reason code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from cua_rl.core.reasons import Reason
from cua_rl.errors import RejectedEpisode

# Action names an agent uses when the model's reply could not be turned into an action.
PARSE_FAILURE_ACTIONS = frozenset(
    {"parse_error", "parse_failed", "invalid", "invalid_action", "unparsed", "error"}
)


@dataclass
class Turn:
    """One model call and what came of it."""

    step: int
    index: int  # order of the turn in the episode, 0-based
    prompt_ids: list[int] | None
    output_ids: list[int] | None
    output_logprobs: list[float] | None
    finish_reason: str | None
    image_urls: list[str]
    messages: list[dict] | None  # the request's messages (for the retokenising fallback)
    text: str | None  # the assistant text of the reply
    actions: list[dict] = field(default_factory=list)
    action_parsed: bool = False
    action_ok: bool = False
    errors: list[str] = field(default_factory=list)
    missing: str | None = None  # which token data the model output lacked, if any
    # The policy version that sampled each output token, when the source knows it (the
    # gateway does); otherwise the row builder applies one version per turn.
    output_versions: list[int] | None = None
    response_id: str | None = None  # the chat completion's id (the gateway's turns match on it)
    # What the source noted about the call (the gateway: sampling settings the agent asked for
    # and the trainer replaced, weight-update aborts); recorded with the turn in the monitor.
    notes: dict = field(default_factory=dict)
    # The agent's step this turn belongs to, in epoch seconds: its first and last event's ``ts``
    # (step_start .. step_end on a complete log). None when the events carry no readable ts.
    started_at: float | None = None
    ended_at: float | None = None

    @property
    def action(self) -> dict | None:
        return self.actions[0] if self.actions else None


@dataclass
class ParsedEvents:
    turns: list[Turn]
    run_ok: bool | None = None
    run_reason: str | None = None
    answer: str | None = None  # the `finished` action's content
    duplicates: int = 0
    incomplete_turns: int = 0  # model calls without a model output (the call failed)
    errors: list[str] = field(default_factory=list)


def load_event_log(obj: Any) -> list[dict]:
    """Accept a JSON object with an ``events`` list, a bare list, or JSON text of either."""
    if isinstance(obj, str | bytes):
        try:
            obj = json.loads(obj)
        except ValueError as exc:
            raise RejectedEpisode(Reason.MALFORMED_EVENTS, f"event log is not JSON: {exc}") from exc
    if isinstance(obj, Mapping):
        obj = obj.get("events")
    if not isinstance(obj, list):
        raise RejectedEpisode(
            Reason.MALFORMED_EVENTS, "expected a list of events or an object with an 'events' list"
        )
    return obj


def _step_of(ev: Mapping, i: int) -> int:
    step = ev.get("step", ev.get("turn"))
    if isinstance(step, bool) or not isinstance(step, int | float) or step != int(step):
        raise RejectedEpisode(Reason.MALFORMED_EVENTS, f"event {i} ({ev.get('type')}) has no step")
    return int(step)


def event_time(ts: Any) -> float | None:
    """An event's ``ts`` in epoch seconds: ISO 8601 (``Z`` or an offset; naive means UTC) or
    epoch milliseconds. None for anything else: timing is informative, never a rejection."""
    if isinstance(ts, bool):
        return None
    if isinstance(ts, int | float):
        return float(ts) / 1000.0 if math.isfinite(ts) else None
    if not isinstance(ts, str) or not ts.strip():
        return None
    text = ts.strip()
    try:
        return float(text) / 1000.0
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def dedupe_events(events: Iterable[Any]) -> tuple[list[dict], int]:
    """Drop repeats of (type, ts, step, actionIndex), keeping first arrival order."""
    seen: set[tuple] = set()
    out: list[dict] = []
    dups = 0
    for i, ev in enumerate(events):
        if not isinstance(ev, Mapping) or not isinstance(ev.get("type"), str):
            raise RejectedEpisode(
                Reason.MALFORMED_EVENTS, f"event {i} is not an object with a type"
            )
        key = (ev["type"], str(ev.get("ts")), ev.get("step", ev.get("turn")), ev.get("actionIndex"))
        if key in seen:
            dups += 1
            continue
        seen.add(key)
        out.append(dict(ev))
    return out, dups


def request_messages(call: Mapping) -> list[dict] | None:
    """The OpenAI messages of a model_call event, from whichever field the agent used."""
    for key in ("modelSpecificInput", "modelInput"):
        req = call.get(key)
        if isinstance(req, Mapping) and isinstance(req.get("messages"), list):
            return list(req["messages"])
        if isinstance(req, list):
            return list(req)
    msgs = call.get("messages")
    return list(msgs) if isinstance(msgs, list) else None


def image_urls_of(messages: Sequence[Any] | None) -> list[str]:
    """Image URLs in prompt order: ``image_url`` parts and ``image`` parts (``url``/``image``)."""
    urls: list[str] = []
    for msg in messages or ():
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping):
                continue
            kind = part.get("type")
            url = None
            if kind == "image_url":
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, Mapping) else ref
            elif kind == "image":
                url = part.get("url") or part.get("image")
            else:
                continue
            if not isinstance(url, str) or not url:
                raise RejectedEpisode(Reason.MALFORMED_EVENTS, f"image part without a URL: {kind}")
            urls.append(url)
    return urls


def _int_list(value: Any) -> list[int] | None:
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return None
    return list(value)


def parse_model_output(output: Any) -> dict:
    """Token data of one chat-completion response; absent pieces are reported in ``missing``."""
    if not isinstance(output, Mapping):
        return {"missing": "model_output", "prompt_ids": None, "output_ids": None,
                "logprobs": None, "finish_reason": None, "text": None, "id": None}  # fmt: skip
    choices = output.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    choice = choice if isinstance(choice, Mapping) else {}
    prompt_ids = _int_list(output.get("prompt_token_ids"))
    output_ids = _int_list(choice.get("token_ids"))
    logprobs = None
    content = (
        (choice.get("logprobs") or {}).get("content")
        if isinstance(choice.get("logprobs"), Mapping)
        else None
    )
    if isinstance(content, list) and content:
        vals = [c.get("logprob") if isinstance(c, Mapping) else None for c in content]
        if all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v <= 0
            for v in vals
        ):
            logprobs = [float(v) for v in vals]
    missing = []
    if prompt_ids is None:
        missing.append("prompt_token_ids")
    if output_ids is None:
        missing.append("token_ids")
    if logprobs is None:
        missing.append("logprobs")
    elif output_ids is not None and len(logprobs) != len(output_ids):
        missing.append("logprobs_length")
    message = choice.get("message") if isinstance(choice.get("message"), Mapping) else {}
    text = message.get("content") if isinstance(message.get("content"), str) else None
    return {
        "missing": ",".join(missing) or None,
        "prompt_ids": prompt_ids,
        "output_ids": output_ids,
        "logprobs": logprobs,
        "finish_reason": choice.get("finish_reason"),
        "text": text,
        "id": output.get("id") if isinstance(output.get("id"), str) else None,
    }


def _action_parsed(action: Mapping) -> bool:
    name = action.get("name")
    return isinstance(name, str) and bool(name) and name.lower() not in PARSE_FAILURE_ACTIONS


def _action_ok(action: Mapping) -> bool:
    if not _action_parsed(action):
        return False
    result = action.get("rawResult")
    if isinstance(result, Mapping):
        if result.get("ok") is False or result.get("success") is False or result.get("error"):
            return False
    return True


def _turn(step: int, index: int, call: dict, out: dict, acts: list, errors: list, span) -> Turn:
    """One model call of a step and its answer (with the step's actions when it is the last)."""
    messages = request_messages(call)
    data = parse_model_output(out.get("modelOutput"))
    return Turn(
        step=step,
        index=index,
        prompt_ids=data["prompt_ids"],
        output_ids=data["output_ids"],
        output_logprobs=data["logprobs"],
        finish_reason=data["finish_reason"],
        image_urls=image_urls_of(messages),
        messages=messages,
        text=data["text"],
        actions=acts,
        action_parsed=bool(acts) and all(_action_parsed(a) for a in acts),
        action_ok=bool(acts) and all(_action_ok(a) for a in acts),
        errors=errors,
        missing=data["missing"],
        response_id=data["id"],
        started_at=span[0],
        ended_at=span[1],
    )


def events_to_turns(events: Any) -> ParsedEvents:
    """Turn an event log (list, ``{"events": [...]}`` or JSON text) into ordered turns."""
    raw = load_event_log(events)
    evs, dups = dedupe_events(raw)
    parsed = ParsedEvents(turns=[], duplicates=dups)
    calls: dict[int, list[dict]] = {}
    outputs: dict[int, list[dict]] = {}
    actions: dict[int, list[dict]] = {}
    step_errors: dict[int, list[str]] = {}
    step_order: list[int] = []
    spans: dict[int, tuple[float, float]] = {}  # step -> (first ts, last ts), step_start/end too
    for i, ev in enumerate(evs):
        kind = ev["type"]
        # run_end carries the last step's number but marks the run's end, not the step's.
        when = event_time(ev.get("ts")) if kind != "run_end" else None
        step_no = ev.get("step", ev.get("turn"))
        if when is not None and isinstance(step_no, int) and not isinstance(step_no, bool):
            lo, hi = spans.get(step_no, (when, when))
            spans[step_no] = (min(lo, when), max(hi, when))
        if kind == "run_end":
            parsed.run_ok = ev.get("ok") if isinstance(ev.get("ok"), bool) else None
            parsed.run_reason = ev.get("reason") if isinstance(ev.get("reason"), str) else None
            continue
        if kind not in ("model_call", "model_output", "action_executed", "error"):
            continue
        if kind == "error" and ev.get("step", ev.get("turn")) is None:
            parsed.errors.append(str(ev.get("message", "")))
            continue
        step = _step_of(ev, i)
        if step not in step_order:
            step_order.append(step)
        if kind == "model_call":
            calls.setdefault(step, []).append(ev)
        elif kind == "model_output":
            outputs.setdefault(step, []).append(ev)
        elif kind == "action_executed":
            action = ev.get("action")
            if not isinstance(action, Mapping):
                raise RejectedEpisode(
                    Reason.MALFORMED_EVENTS, f"action_executed event {i} has no action"
                )
            actions.setdefault(step, []).append(ev)
        else:
            step_errors.setdefault(step, []).append(str(ev.get("message", "")))
    for step in sorted(step_order):
        step_calls, step_outs = calls.get(step, []), outputs.get(step, [])
        if len(step_outs) > len(step_calls):
            raise RejectedEpisode(
                Reason.MALFORMED_EVENTS,
                f"step {step} has {len(step_outs)} outputs for {len(step_calls)} model calls",
            )
        parsed.incomplete_turns += len(step_calls) - len(step_outs)
        step_actions = sorted(
            actions.get(step, []),
            key=lambda e: e.get("actionIndex") if isinstance(e.get("actionIndex"), int) else 0,
        )
        for k, (call, out) in enumerate(zip(step_calls, step_outs, strict=False)):
            # Actions belong to the step's last model call: earlier calls of a step were retries.
            last = k == len(step_outs) - 1
            acts = [dict(e["action"]) for e in step_actions] if last else []
            errors = list(step_errors.get(step, [])) if last else []
            span = spans.get(step, (None, None))
            parsed.turns.append(_turn(step, len(parsed.turns), call, out, acts, errors, span))
            for a in acts:
                if a.get("name") == "finished":
                    content = (a.get("args") or {}).get("content")
                    if isinstance(content, str):
                        parsed.answer = content
    return parsed
