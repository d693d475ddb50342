"""MAI-UI's format: a thought in ``<thinking>`` tags, then one ``mobile_use`` tool call.

MAI-UI (Tongyi Lab, on Qwen3-VL) is prompted with its action space as JSON argument shapes of one
function, ``mobile_use``, and answers ``<thinking>...</thinking>`` followed by
``<tool_call>{"name": "mobile_use", "arguments": {"action": ...}}</tool_call>``. Points are on the
0-999 grid. Besides GUI actions it can answer, ask the user (``ask_user``, or ``INFO`` in its
older prompt) and call MCP tools listed in the prompt, with the tool's own name in the call.
Source: the MAI-UI repository's agent prompts and parser (src/prompt.py, SCALE_FACTOR 999).

How the sim executes them: ``click``, ``double_click`` and ``long_press`` tap; ``swipe`` moves a
third of the screen the named way from its point (default the centre); ``drag`` swipes;
``system_button`` back/home are the system keys, enter is the enter key, menu is sent to the
gym, which refuses it; ``open``/``AWAKE`` are sent to the gym as ``open`` (refused: the sim has
no launcher by name); ``wait`` waits a second; ``answer`` and ``terminate`` finish the run
(``answer``'s text is the final answer); ``ask_user`` and MCP calls are recorded and answered by
the agent without touching the gym.
"""

from __future__ import annotations

import json

from cua_rl.agent.actions import LENIENT_GRID, Action, ActionParseError
from cua_rl.agent.flavours.toolcall import (
    call_of,
    canonical_call,
    first_tool_call,
    lenient_tap,
    swipe_towards,
    thought_of,
    to_pixels,
    tool_call_block,
)

NAME = "mai-ui"
FUNCTION = "mobile_use"

_ACTIONS = (
    '{"action": "click", "coordinate": [x, y]}',
    '{"action": "long_press", "coordinate": [x, y]}',
    '{"action": "double_click", "coordinate": [x, y]}',
    '{"action": "type", "text": ""}',
    '{"action": "swipe", "direction": "up or down or left or right", "coordinate": [x, y]}'
    "  (coordinate optional: where to start)",
    '{"action": "drag", "start_coordinate": [x1, y1], "end_coordinate": [x2, y2]}',
    '{"action": "open", "text": "app_name"}',
    '{"action": "system_button", "button": "back or home or menu or enter"}',
    '{"action": "wait"}',
    '{"action": "answer", "text": "xxx"}',
    '{"action": "ask_user", "text": "xxx"}',
    '{"action": "terminate", "status": "success or fail"}',
)


# What the prompt says the agent operates, per standardActionSpace: MAI-UI's prompt names a
# phone; on a desktop or a web page (MiniWoB) that would describe a device the model does not see.
_DEVICE = {"mobile": "a phone", "pc": "a computer screen showing a web page"}


def system_prompt(tools: list[dict] | None = None, device: str = "mobile") -> str:
    lines = [
        f"You are a GUI agent operating {_DEVICE[device]}. You get the task, your earlier "
        "actions and a screenshot per step; choose the next action.",
        "",
        "## Output Format",
        "First your reasoning in <thinking> </thinking> tags, then the action as a JSON object "
        "with the function name and arguments in <tool_call></tool_call> tags:",
        "<thinking>\n...\n</thinking>",
        f'<tool_call>\n{{"name": "{FUNCTION}", "arguments": <args-json-object>}}\n</tool_call>',
        "",
        "## Action Space",
        "",
        *_ACTIONS,
        "",
        "Points are [x, y] on a 0-999 grid over the screenshot, (0, 0) at the top left.",
    ]
    if tools:
        lines += [
            "",
            "## MCP Tools",
            "You may also call these tools, with the tool's name as the function name:",
            *(json.dumps(t, ensure_ascii=False) for t in tools),
        ]
    return "\n".join(lines)


def parse_mobile_use(args: dict, width: int, height: int, text: str) -> Action:
    """One ``mobile_use`` argument object -> the sim's action."""
    action = args.get("action")

    def point(key: str = "coordinate") -> tuple[int, int]:
        return to_pixels(args.get(key), width, height)

    if action in ("click", "double_click", "long_press", "left_click"):
        x, y = point()
        return Action("tap", {"x": x, "y": y}, text)
    if action == "type":
        return Action("type", {"text": str(args.get("text", ""))}, text)
    if action == "swipe":
        if "coordinate2" in args:  # Qwen3-VL's form: from one point to another
            (x1, y1), (x2, y2) = point(), point("coordinate2")
            return Action("swipe", {"x1": x1, "y1": y1, "x2": x2, "y2": y2}, text)
        start = point() if "coordinate" in args else (width // 2, height // 2)
        return Action("swipe", swipe_towards(args.get("direction"), start, width, height), text)
    if action == "drag":
        (x1, y1), (x2, y2) = point("start_coordinate"), point("end_coordinate")
        return Action("swipe", {"x1": x1, "y1": y1, "x2": x2, "y2": y2}, text)
    if action == "system_button":
        button = str(args.get("button", "")).lower()
        if button in ("back", "home"):
            return Action(button, {}, text)
        return Action("key", {"key": button}, text)
    if action in ("open", "AWAKE"):
        return Action("open", {"app": str(args.get("text", ""))}, text)
    if action == "wait":
        return Action("wait", {"seconds": float(args.get("time", 1))}, text)
    if action == "answer":
        return Action("finished", {"text": str(args.get("text", ""))}, text)
    if action == "terminate":
        return Action("finished", {"text": "", "status": str(args.get("status", ""))}, text)
    if action in ("ask_user", "INFO"):
        return Action("ask_user", {"text": str(args.get("text", ""))}, text)
    raise ActionParseError(f"unknown {FUNCTION} action {action!r}")


def read_reply(
    text: str, width: int, height: int, *, lenient: bool = False, grid: int = LENIENT_GRID
) -> Action:
    try:
        name, args = first_tool_call(text)
        if name != FUNCTION:
            action = Action("mcp_call", {"tool": name, "arguments": args}, text)
        else:
            action = parse_mobile_use(args, width, height, text)
        action.call, action.thought = canonical_call(name, args), thought_of(text)
        return action
    except ActionParseError:
        if not lenient or not isinstance(text, str) or not text.strip():
            raise
        return lenient_tap(text, width, height, grid)


def render(action: Action, width: int, height: int, device: str = "mobile") -> str:
    """The assistant text MAI-UI's agent puts in its history for a parsed action: the thought in
    ``<thinking>`` and the call as compact JSON, never the sampled text (MAI-UI keeps
    ``mobile_use`` on every device)."""
    call = tool_call_block(call_of(action, FUNCTION, width, height))
    return f"<thinking>\n{action.thought}\n</thinking>\n{call}"


def describe(action: Action, width: int, height: int, device: str = "mobile") -> str:
    """One line for a textual list of earlier actions: the call's compact JSON."""
    return json.dumps(call_of(action, FUNCTION, width, height), separators=(",", ":"))
