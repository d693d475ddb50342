"""What one rollout page shows per turn and of its training, from plain records (no database).

Split from ``views.py``: how a turn's screenshot, actions and tokens are drawn, and what the
rollout's rows trained. The trainer writes an episode's conversion stats into the rollout's
``metrics_json`` (the seed's rollout table has no such column, so ingest keeps it in the
rollout's extra fields) and ``trained`` into each turn's ``metrics_json``. A rollout recorded
before those existed, or rejected before its rows were built, has neither: the page shows "–"
(or no pill), never an error.
"""

from __future__ import annotations

import json
import math
from typing import Any

from cua_rl.monitor.protocol import parse_screenshot_uri

LOW_TOKENS = 3  # how many least likely tokens a turn marks


def parse_json(text: Any) -> Any:
    if not isinstance(text, str) or not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def finite_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _count(v: Any) -> int | None:
    """A non-negative whole number, or None for anything else (absent, text, NaN)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return int(v) if v >= 0 and float(v).is_integer() else None


def conversion_view(extra: dict | None) -> dict:
    """The rows the rollout trained and its tokens trained vs sampled; ``dropped_tokens`` > 0
    (sampled tokens no row trains) is what the page highlights."""
    metrics = (extra or {}).get("metrics_json")
    if isinstance(metrics, str):
        metrics = parse_json(metrics)
    conversion = metrics.get("conversion") if isinstance(metrics, dict) else None
    if not isinstance(conversion, dict):
        conversion = {}
    trained = _count(conversion.get("trained_tokens"))
    sampled = _count(conversion.get("sampled_tokens"))
    known = trained is not None and sampled is not None
    return {
        "rows": _count(conversion.get("rows")),
        "trained_tokens": trained,
        "sampled_tokens": sampled,
        "dropped_tokens": sampled - trained if known and trained < sampled else 0,
        "dropped_turns": _count(conversion.get("dropped_turns")),
    }


def credit_view(extra: dict | None) -> dict | None:
    """A turn's step credit (its ``step_credit`` extra field, written by the group filter when
    ``step_credit`` is on: cua_rl/credit): the advantage its tokens got on top of the episode's,
    its return, state key and step group; None when not recorded."""
    found = (extra or {}).get("step_credit")
    if isinstance(found, str):
        found = parse_json(found)
    if not isinstance(found, dict):
        return None
    key = found.get("state_key")
    size = _count(found.get("step_group_size"))
    return {
        "advantage": finite_or_none(found.get("advantage")),
        "ret": finite_or_none(found.get("return")),
        "state_key": key if isinstance(key, str) and key else None,
        "group_size": size,
        "alone": size is not None and size < 2,
        "false_merge": found.get("false_merge") is True,
    }


def trained_flag(metrics: Any) -> bool | None:
    """Whether a row trains the turn (its ``metrics_json.trained``); None when not recorded."""
    value = metrics.get("trained") if isinstance(metrics, dict) else None
    return value if isinstance(value, bool) else None


def screenshot_view(obs: dict | None) -> dict | None:
    if obs is None:
        return None
    extra = obs.get("extra") or {}
    digest = parse_screenshot_uri(obs.get("screenshot_uri"))
    width = extra.get("source_width") or extra.get("image_width")
    height = extra.get("source_height") or extra.get("image_height")
    return {
        "sha256": digest,
        "uri": obs.get("screenshot_uri"),
        "width": width if isinstance(width, int) and width > 0 else None,
        "height": height if isinstance(height, int) and height > 0 else None,
        "error": extra.get("screenshot_error"),
    }


def _point(args: dict, *names: str) -> tuple[float, float] | None:
    for name in names:
        p = args.get(name)
        if (
            isinstance(p, dict)
            and finite_or_none(p.get("x")) is not None
            and finite_or_none(p.get("y")) is not None
        ):
            return float(p["x"]), float(p["y"])
        if (
            isinstance(p, list | tuple)
            and len(p) == 2
            and all(finite_or_none(v) is not None for v in p)
        ):
            return float(p[0]), float(p[1])
    return None


def action_overlay(name: Any, args: Any) -> dict:
    """How to draw one action on its screenshot: a tap point, a swipe arrow or a text label.

    Coordinates are the screenshot pixels the agent saw (``point{x,y}``, ``startPoint`` /
    ``endPoint``, or flat ``x, y`` / ``x1, y1, x2, y2`` as the sim gym takes them).
    """
    name = str(name or "action")
    args = args if isinstance(args, dict) else {}
    start = _point(args, "startPoint", "start", "from")
    end = _point(args, "endPoint", "end", "to")
    if start is None and all(
        finite_or_none(args.get(k)) is not None for k in ("x1", "y1", "x2", "y2")
    ):
        start = (float(args["x1"]), float(args["y1"]))
        end = (float(args["x2"]), float(args["y2"]))
    if start and end:
        return {
            "kind": "swipe",
            "name": name,
            "x": start[0],
            "y": start[1],
            "x2": end[0],
            "y2": end[1],
        }
    point = _point(args, "point", "position", "coordinate")
    if (
        point is None
        and finite_or_none(args.get("x")) is not None
        and finite_or_none(args.get("y")) is not None
    ):
        point = (float(args["x"]), float(args["y"]))
    if point:
        return {"kind": "tap", "name": name, "x": point[0], "y": point[1]}
    text = args.get("content", args.get("text", args.get("key", args.get("direction"))))
    label = name if text in (None, "") else f"{name}: {text}"
    return {"kind": "label", "name": name, "text": label}


def token_view(actions: list[dict]) -> dict | None:
    """The reply's tokens (on the turn's first action) with the least likely ones marked."""
    for a in actions:
        tokens, logprobs = parse_json(a.get("tokens")), parse_json(a.get("logprobs"))
        if not isinstance(tokens, list) or not tokens:
            continue
        if not isinstance(logprobs, list) or len(logprobs) != len(tokens):
            logprobs = [None] * len(tokens)
        texts = (a.get("extra") or {}).get("token_texts")
        if not isinstance(texts, list) or len(texts) != len(tokens):
            texts = None
        finite = [(lp, i) for i, lp in enumerate(logprobs) if finite_or_none(lp) is not None]
        low = {i for _, i in sorted(finite)[:LOW_TOKENS]}
        items = [
            {
                "id": tok,
                "text": texts[i] if texts else None,
                "logprob": logprobs[i],
                "low": i in low,
            }
            for i, tok in enumerate(tokens)
        ]
        mean = sum(lp for lp, _ in finite) / len(finite) if finite else None
        return {"count": len(tokens), "mean_logprob": mean, "items": items}
    return None
