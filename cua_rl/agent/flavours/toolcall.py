"""Hermes-style tool calls in a reply, and the 0-999 screen grid both Qwen-based agents point on.

A reply may hold free text (a thought) and then ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``; the first block is the action. MAI-UI and Qwen3-VL give coordinates on a
grid of 0-999 over the screenshot, whatever its size: pixels are ``x / 999 * width``.
"""

from __future__ import annotations

import json
import math
import re

from cua_rl.agent.actions import LENIENT_GRID, Action, ActionParseError, grid_cell_centre

GRID = 999
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

# The function-calling instructions Qwen chat templates write into the system message.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def first_tool_call(text: str) -> tuple[str, dict]:
    """(function name, arguments) of the reply's first ``<tool_call>`` block."""
    if not isinstance(text, str) or not text.strip():
        raise ActionParseError("empty model output")
    match = _BLOCK.search(text)
    if match is None:
        raise ActionParseError(f"no <tool_call> block in {text[:120]!r}")
    try:
        call = json.loads(match.group(1))
    except ValueError as exc:
        raise ActionParseError(f"<tool_call> is not JSON: {exc}") from exc
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ActionParseError("<tool_call> must be an object with a string 'name'")
    args = call.get("arguments", {})
    if isinstance(args, str):  # some servers send arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError as exc:
            raise ActionParseError(f"arguments are not JSON: {exc}") from exc
    if not isinstance(args, dict):
        raise ActionParseError("arguments must be a JSON object")
    return call["name"], args


_THINKING = re.compile(r"</?think(?:ing)?>")
_POINT_KEYS = ("coordinate", "coordinate2", "start_coordinate", "end_coordinate")


def thought_of(text: str) -> str:
    """The reasoning before a reply's first ``<tool_call>``, without its thinking tags."""
    head = text.split("<tool_call>", 1)[0] if isinstance(text, str) else ""
    return _THINKING.sub("", head).strip()


def canonical_call(name: str, args: dict) -> dict:
    """A parsed call as the history re-renders it: points as integer grid coordinates."""
    out = dict(args)
    for key in _POINT_KEYS:
        value = out.get(key)
        if isinstance(value, list | tuple) and len(value) == 2:
            if all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
                out[key] = [int(round(v)) for v in value]
    return {"name": name, "arguments": out}


def tool_call_block(call: dict) -> str:
    """``<tool_call>`` with the call as compact JSON (MAI-UI's history form)."""
    body = json.dumps(call, ensure_ascii=False, separators=(",", ":"))
    return f"<tool_call>\n{body}\n</tool_call>"


def to_grid(x: int, y: int, width: int, height: int, grid: int = GRID) -> list[int]:
    """Screenshot pixels as a point on the 0-``grid`` scale. Rounded up, so that ``to_pixels``
    (which truncates) gives the same pixel back on screens up to ``grid`` pixels wide."""
    return [min(math.ceil(x * grid / width), grid), min(math.ceil(y * grid / height), grid)]


def call_of(action: Action, function: str, width: int, height: int, click: str = "click") -> dict:
    """The flavour's call of a parsed action: the one the reply made, or for a lenient tap (a
    reply with no call) a click at the tapped point."""
    if action.call is not None:
        return action.call
    if action.name == "tap":
        point = to_grid(action.params["x"], action.params["y"], width, height)
        return {"name": function, "arguments": {"action": click, "coordinate": point}}
    raise ValueError(f"action {action.name!r} carries no {function} call to re-render")


def to_pixels(value, width: int, height: int, grid: int = GRID) -> tuple[int, int]:
    """A [x, y] point on the 0-``grid`` scale as screenshot pixels."""
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    ):
        raise ActionParseError(f"coordinate must be [x, y] numbers, got {value!r}")
    x, y = value
    if not (0 <= x <= grid and 0 <= y <= grid):
        raise ActionParseError(f"coordinate {value!r} is outside the 0-{grid} grid")
    return (min(int(x / grid * width), width - 1), min(int(y / grid * height), height - 1))


def lenient_tap(text: str, width: int, height: int, grid: int = LENIENT_GRID) -> Action:
    """The sim's fallback for a reply with no call: tap the grid cell its first character names."""
    first = text.strip()[0]
    x, y = grid_cell_centre(ord(first), width, height, grid)
    return Action(name="tap", params={"x": x, "y": y}, text=first)


def swipe_towards(direction: str, start: tuple[int, int], width: int, height: int) -> dict:
    """A swipe from ``start`` a third of the screen towards ``direction`` (the finger's way)."""
    dx, dy = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}.get(
        str(direction).lower(), (None, None)
    )
    if dx is None:
        raise ActionParseError(f"swipe direction must be up, down, left or right: {direction!r}")
    x, y = start
    x2 = min(max(x + dx * (width // 3), 0), width - 1)
    y2 = min(max(y + dy * (height // 3), 0), height - 1)
    return {"x1": x, "y1": y, "x2": x2, "y2": y2}
