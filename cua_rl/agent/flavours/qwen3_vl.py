"""Qwen3-VL's computer-use format: the ``mobile_use`` (phones) or ``computer_use`` (desktops)
function declared in the system message's ``<tools>`` block, called as a Hermes tool call.

Qwen3-VL's agent examples declare one function whose ``action`` argument picks the operation and
whose points are on a 0-999 grid over the screenshot; the model replies (after optional text)
``<tool_call>\\n{"name": "mobile_use", "arguments": {"action": "click", "coordinate": [x, y]}}
\\n</tool_call>``. ``mobile_use`` actions: ``click``, ``long_press``, ``swipe`` (``coordinate``
to ``coordinate2``), ``type``, ``key``, ``system_button`` (Back, Home, Menu, Enter), ``open``,
``wait`` (``time`` seconds), ``answer``, ``terminate`` (``status``). ``computer_use`` actions
read here: ``left_click``, ``double_click``, ``right_click``, ``type``, ``key`` (``keys``),
``scroll`` (``pixels``, negative is down), ``wait``, ``answer``, ``terminate``.
Source: the Qwen3-VL model card and cookbooks (mobile agent, computer use).

The sim executes them as the MAI-UI flavour does (``cua_rl.agent.flavours.mai_ui``): clicks and
long presses tap, keys other than back/home go to the gym's key action.
"""

from __future__ import annotations

import json

from cua_rl.agent.actions import LENIENT_GRID, Action, ActionParseError
from cua_rl.agent.flavours.mai_ui import parse_mobile_use
from cua_rl.agent.flavours.toolcall import (
    TOOLS_POSTAMBLE,
    TOOLS_PREAMBLE,
    call_of,
    canonical_call,
    first_tool_call,
    lenient_tap,
    thought_of,
    to_pixels,
    tool_call_block,
)

NAME = "qwen3-vl"

_ACTION_HELP = (
    "The action to perform:\n"
    "* `click`: tap the point `coordinate`.\n"
    "* `long_press`: press the point `coordinate` for `time` seconds.\n"
    "* `swipe`: swipe from `coordinate` to `coordinate2`.\n"
    "* `type`: enter `text` into the focused input box.\n"
    "* `key`: send the key event `text` (adb keyevent names).\n"
    "* `system_button`: press `button` (Back, Home, Menu or Enter).\n"
    "* `open`: open the app named `text`.\n"
    "* `wait`: wait `time` seconds.\n"
    "* `answer`: give the final answer `text`.\n"
    "* `terminate`: end the task with `status` success or failure."
)
MOBILE_USE = {
    "type": "function",
    "function": {
        "name": "mobile_use",
        "description": "Operate a phone touchscreen and see the result as a screenshot. Points "
        "are [x, y] on a 0-999 grid over the screen, (0, 0) at the top left; tap the centre "
        "of an element.",
        "parameters": {
            "type": "object",
            "required": ["action"],
            "properties": {
                "action": {
                    "type": "string",
                    "description": _ACTION_HELP,
                    "enum": [
                        "click",
                        "long_press",
                        "swipe",
                        "type",
                        "key",
                        "system_button",
                        "open",
                        "wait",
                        "answer",
                        "terminate",
                    ],  # fmt: skip
                },
                "coordinate": {
                    "type": "array",
                    "description": "[x, y] for click, long_press, swipe",
                },
                "coordinate2": {"type": "array", "description": "[x, y] where a swipe ends"},
                "text": {"type": "string", "description": "for type, key, open and answer"},
                "button": {"type": "string", "enum": ["Back", "Home", "Menu", "Enter"]},
                "time": {"type": "number", "description": "seconds, for long_press and wait"},
                "status": {"type": "string", "enum": ["success", "failure"]},
            },
        },
    },
}


_COMPUTER_HELP = (
    "The action to perform:\n"
    "* `left_click`: click the point `coordinate`.\n"
    "* `double_click`: double-click the point `coordinate`.\n"
    "* `right_click`: right-click the point `coordinate`.\n"
    "* `type`: type `text` into the focused element.\n"
    "* `key`: press the keys `keys` (the last one is sent).\n"
    "* `scroll`: scroll by `pixels` (negative scrolls down).\n"
    "* `wait`: wait `time` seconds.\n"
    "* `answer`: give the final answer `text`.\n"
    "* `terminate`: end the task with `status` success or failure."
)
COMPUTER_USE = {
    "type": "function",
    "function": {
        "name": "computer_use",
        "description": "Use a mouse and keyboard to interact with a computer screen showing a "
        "web page, and see the result as a screenshot. Points are [x, y] on a 0-999 grid over "
        "the screen, (0, 0) at the top left; click the centre of an element.",
        "parameters": {
            "type": "object",
            "required": ["action"],
            "properties": {
                "action": {
                    "type": "string",
                    "description": _COMPUTER_HELP,
                    "enum": [
                        "left_click",
                        "double_click",
                        "right_click",
                        "type",
                        "key",
                        "scroll",
                        "wait",
                        "answer",
                        "terminate",
                    ],  # fmt: skip
                },
                "coordinate": {"type": "array", "description": "[x, y] for the clicks"},
                "keys": {"type": "array", "description": "key names, for key"},
                "text": {"type": "string", "description": "for type and answer"},
                "pixels": {"type": "number", "description": "for scroll"},
                "time": {"type": "number", "description": "seconds, for wait"},
                "status": {"type": "string", "enum": ["success", "failure"]},
            },
        },
    },
}
# The function a device is operated with (standardActionSpace): Qwen3-VL's mobile agent declares
# mobile_use, its computer-use agent computer_use; lenient taps click with that function's verb.
FUNCTIONS = {"mobile": (MOBILE_USE, "click"), "pc": (COMPUTER_USE, "left_click")}


def system_prompt(tools: list[dict] | None = None, device: str = "mobile") -> str:
    listed = [FUNCTIONS[device][0], *(tools or [])]
    body = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in listed)
    return TOOLS_PREAMBLE + body + TOOLS_POSTAMBLE


def _computer_use(args: dict, width: int, height: int, text: str) -> Action:
    action = args.get("action")
    if action in ("left_click", "double_click", "right_click", "triple_click"):
        x, y = to_pixels(args.get("coordinate"), width, height)
        return Action("tap", {"x": x, "y": y}, text)
    if action == "key":
        keys = args.get("keys") or []
        return Action("key", {"key": str(keys[-1] if keys else "").lower()}, text)
    if action == "scroll":
        pixels = float(args.get("pixels", 0))
        cx, cy = width // 2, height // 2
        # Scrolling down moves the content up: the finger goes up.
        y2 = max(
            min(int(cy + (pixels / abs(pixels) if pixels else 0) * height // 3), height - 1), 0
        )
        return Action("swipe", {"x1": cx, "y1": cy, "x2": cx, "y2": y2}, text)
    return parse_mobile_use(args, width, height, text)


def read_reply(
    text: str, width: int, height: int, *, lenient: bool = False, grid: int = LENIENT_GRID
) -> Action:
    try:
        name, args = first_tool_call(text)
        if name == "mobile_use":
            if args.get("action") == "key":
                action = Action("key", {"key": str(args.get("text", "")).lower()}, text)
            else:
                action = parse_mobile_use(args, width, height, text)
        elif name == "computer_use":
            action = _computer_use(args, width, height, text)
        else:
            raise ActionParseError(
                f"unknown function {name!r}; expected mobile_use or computer_use"
            )
        action.call, action.thought = canonical_call(name, args), thought_of(text)
        return action
    except ActionParseError:
        if not lenient or not isinstance(text, str) or not text.strip():
            raise
        return lenient_tap(text, width, height, grid)


def describe(action: Action, width: int, height: int, device: str = "mobile") -> str:
    """One line for a textual list of earlier actions: the call's compact JSON."""
    function, click = FUNCTIONS[device][0]["function"]["name"], FUNCTIONS[device][1]
    return json.dumps(call_of(action, function, width, height, click), separators=(",", ":"))


def render(action: Action, width: int, height: int, device: str = "mobile") -> str:
    """The assistant text for a parsed action: its thought (if any), then the call as compact
    JSON in ``<tool_call>`` tags, as the chat template writes a tool call."""
    function, click = FUNCTIONS[device][0]["function"]["name"], FUNCTIONS[device][1]
    call = tool_call_block(call_of(action, function, width, height, click))
    return f"{action.thought}\n{call}" if action.thought else call
