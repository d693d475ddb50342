"""The local agent's action language: one call per model output, parsed and constrained.

The model answers with exactly one call (anything around it, e.g. a thought, is ignored; the first
call found wins)::

    tap(X, Y)                 tap at screenshot pixel (X, Y)
    swipe(X1, Y1, X2, Y2)     swipe from (X1, Y1) to (X2, Y2)
    type("TEXT")              type TEXT (JSON string escapes)
    key(NAME)                 press a key: enter, backspace, space, back, home
    back()                    system back
    home()                    system home
    wait(SECONDS)             wait 1-9 seconds
    finished("ANSWER")        end the task; ANSWER is the final answer

With lenient reading (``read_reply(..., lenient=True)``) every non-empty reply is an action: a
valid call as written, otherwise a tap at the centre of the cell of a 3x3 grid over the screen
that the reply's first non-space character names (its code point modulo 9, cells numbered row by
row; a finer ``grid`` makes a chance tap rarer, docs/learning.md's learn-hard family). A randomly initialised model then acts on the screen without grammar-constrained
decoding (whose logprobs the trainer cannot reproduce), and what it emits decides what it taps.

``action_regex`` is the same language as a regular expression that vLLM's structured outputs
accept (bounded lengths, so it fits a small ``max_tokens``); ``to_event_args`` / ``to_gym_action``
translate a parsed call into gbox-mini-agent event args and the sim gym's action body.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

ACTION_NAMES = ("tap", "swipe", "type", "key", "back", "home", "wait", "finished")
KEYS = ("enter", "backspace", "space", "back", "home")

_NUM = r"\s*(-?\d+)\s*"
_STR = r'\s*("(?:[^"\\]|\\.)*")\s*'
_PATTERNS = {
    "tap": rf"tap\({_NUM},{_NUM}\)",
    "swipe": rf"swipe\({_NUM},{_NUM},{_NUM},{_NUM}\)",
    "type": rf"type\({_STR}\)",
    "key": r"key\(\s*\"?([A-Za-z_]+)\"?\s*\)",
    "back": r"back\(\s*\)",
    "home": r"home\(\s*\)",
    "wait": r"wait\(\s*(\d+(?:\.\d+)?)\s*\)",
    "finished": rf"finished\({_STR}\)",
}
_ANY = re.compile("|".join(rf"(?P<{name}>(?<![A-Za-z_]){pat})" for name, pat in _PATTERNS.items()))
_SINGLE = {name: re.compile(pat) for name, pat in _PATTERNS.items()}

SYSTEM_PROMPT = (
    "You operate a phone. Each turn you get a screenshot; answer with exactly one action:\n"
    'tap(X, Y) | swipe(X1, Y1, X2, Y2) | type("TEXT") | key(enter|backspace|space|back|home) | back() | '
    'home() | wait(SECONDS) | finished("ANSWER")\n'
    "Coordinates are screenshot pixels. Call finished when the task is done."
)


def system_prompt(device: str = "mobile") -> str:
    """The sim flavour's prompt; ``pc`` (a web page in a browser, e.g. MiniWoB) names the screen
    it shows instead of a phone. The mobile prompt is unchanged: trained runs depend on it."""
    if device == "pc":
        return SYSTEM_PROMPT.replace("You operate a phone.", "You operate a web page on a screen.")
    return SYSTEM_PROMPT


class ActionParseError(ValueError):
    """The model output holds no valid action; the message says what was wrong."""


@dataclass
class Action:
    name: str
    params: dict = field(default_factory=dict)
    text: str = ""  # the matched call, verbatim
    # The flavour's own call with canonical arguments (tool-call flavours): what a context
    # policy re-renders into the history instead of the sampled text (cua_rl.agent.context).
    call: dict | None = None
    thought: str = ""  # the reasoning the reply gave before its call, stripped


def parse_action(output: str) -> Action:
    """The first action call in ``output``; raises ActionParseError when there is none."""
    if not isinstance(output, str) or not output.strip():
        raise ActionParseError("empty model output")
    match = _ANY.search(output)
    if match is None:
        raise ActionParseError(f"no action call found in {output[:120]!r}")
    name = match.lastgroup
    call = match.group(name)
    groups = _SINGLE[name].fullmatch(call).groups()
    if name == "tap":
        params = {"x": int(groups[0]), "y": int(groups[1])}
    elif name == "swipe":
        x1, y1, x2, y2 = (int(g) for g in groups)
        params = {"x1": x1, "y1": y1, "x2": x2, "y2": y2}
    elif name in ("type", "finished"):
        try:
            params = {"text": json.loads(groups[0])}
        except ValueError as exc:
            raise ActionParseError(f"bad string literal in {call!r}: {exc}") from exc
    elif name == "key":
        key = groups[0].lower()
        if key not in KEYS:
            raise ActionParseError(f"unknown key {key!r}; known: {', '.join(KEYS)}")
        params = {"key": key}
    elif name == "wait":
        params = {"seconds": float(groups[0])}
    else:
        params = {}
    return Action(name=name, params=params, text=call)


LENIENT_GRID = 3


def grid_cell_centre(
    cell: int, width: int, height: int, grid: int = LENIENT_GRID
) -> tuple[int, int]:
    """Pixel centre of ``cell`` (row-major) of a ``grid`` x ``grid`` split of the screen."""
    row, col = divmod(cell % (grid * grid), grid)
    return (int((col + 0.5) * width / grid), int((row + 0.5) * height / grid))


def read_reply(
    output: str, width: int, height: int, *, lenient: bool = False, grid: int = LENIENT_GRID
) -> Action:
    """The action of a model reply: strict parsing, or with ``lenient`` the tap on the cell of a
    ``grid`` x ``grid`` split that the first character names."""
    try:
        return parse_action(output)
    except ActionParseError:
        if not lenient or not isinstance(output, str) or not output.strip():
            raise
    first = output.strip()[0]
    x, y = grid_cell_centre(ord(first), width, height, grid)
    return Action(name="tap", params={"x": x, "y": y}, text=first)


def format_action(action: Action) -> str:
    """The canonical text of a parsed action in this language (``tap(300, 106)``): what the
    history holds instead of the sampled reply when a context policy re-renders it."""
    p = action.params
    if action.name == "tap":
        return f"tap({p['x']}, {p['y']})"
    if action.name == "swipe":
        return f"swipe({p['x1']}, {p['y1']}, {p['x2']}, {p['y2']})"
    if action.name in ("type", "finished"):
        return f"{action.name}({json.dumps(p['text'], ensure_ascii=False)})"
    if action.name == "key":
        return f"key({p['key']})"
    if action.name == "wait":
        seconds = p["seconds"]
        return f"wait({int(seconds) if float(seconds).is_integer() else seconds})"
    if action.name in ("back", "home"):
        return f"{action.name}()"
    raise ValueError(f"action {action.name!r} has no form in the sim action language")


def to_event_args(action: Action) -> dict:
    """gbox-mini-agent's ``action.args`` for this call (point / startPoint / content / ...)."""
    p = action.params
    if action.name == "tap":
        return {"point": {"x": p["x"], "y": p["y"]}}
    if action.name == "swipe":
        return {
            "startPoint": {"x": p["x1"], "y": p["y1"]},
            "endPoint": {"x": p["x2"], "y": p["y2"]},
        }
    if action.name in ("type", "finished"):
        return {"content": p["text"]}
    if action.name == "key":
        return {"key": p["key"]}
    if action.name == "wait":
        return {"durationMs": int(p["seconds"] * 1000)}
    return dict(p)


def to_gym_action(action: Action) -> dict | None:
    """The sim gym's ``POST .../actions`` body; ``None`` for ``finished`` (nothing to execute)."""
    if action.name == "finished":
        return None
    if action.name in ("tap", "swipe", "key", "wait"):
        return {"name": action.name, "args": dict(action.params)}
    if action.name == "type":
        return {"name": "type", "args": {"text": action.params["text"]}}
    return {"name": action.name, "args": {}}


def event_args_of_gym_action(action: dict) -> dict:
    """gbox-mini-agent's ``action.args`` for a gym action body (``{name, args}``, what
    ``to_gym_action`` makes): the args a parsed call of the same action records, so an agent that
    acts on the box directly (``agent.mode: function``) is recorded as the loop is. A body
    outside this language keeps its own args."""
    name, args = action.get("name"), action.get("args")
    args = dict(args) if isinstance(args, dict) else {}
    params = {"text": args.get("text")} if name == "type" else args
    try:
        return to_event_args(Action(name=str(name), params=params))
    except (KeyError, TypeError, ValueError):
        return args


_TEXT = '"[a-z ]{0,12}"'
# Longest string the regex admits (swipe with four 4-digit numbers and ", " separators).
REGEX_MAX_CHARS = len("swipe(9999, 9999, 9999, 9999)")


def int_range_regex(upper: int) -> str:
    """Regex for the decimal integers 0..upper-1, without leading zeros."""
    if upper < 1:
        raise ValueError(f"upper must be >= 1, got {upper}")
    top = str(upper - 1)
    parts = ["[0-9]"] if len(top) > 1 else []
    parts += [f"[1-9][0-9]{{{n - 1}}}" for n in range(2, len(top))]
    # Same number of digits as `top`: walk its digits, branching below each one.
    for i, ch in enumerate(top):
        lo = 1 if i == 0 and len(top) > 1 else 0
        if int(ch) > lo:
            rest = len(top) - i - 1
            tail = f"[0-9]{{{rest}}}" if rest else ""
            parts.append(f"{top[:i]}[{lo}-{int(ch) - 1}]{tail}")
    parts.append(top)
    return "(" + "|".join(parts) + ")"


def action_regex(
    names: list[str] | tuple[str, ...] | None = None, width: int = 1000, height: int = 1000
) -> str:
    """A regex for one bounded, on-screen action call, restricted to ``names`` when given."""
    chosen = list(names) if names else list(ACTION_NAMES)
    unknown = [n for n in chosen if n not in ACTION_NAMES]
    if unknown:
        raise ValueError(f"unknown action names {unknown}; known: {', '.join(ACTION_NAMES)}")
    x, y = int_range_regex(width), int_range_regex(height)
    parts = {
        "tap": rf"tap\({x}, ?{y}\)",
        "swipe": rf"swipe\({x}, ?{y}, ?{x}, ?{y}\)",
        "type": rf"type\({_TEXT}\)",
        "key": r"key\((" + "|".join(KEYS) + r")\)",
        "back": r"back\(\)",
        "home": r"home\(\)",
        "wait": r"wait\([1-3]\)",
        "finished": rf"finished\({_TEXT}\)",
    }
    return "(" + "|".join(parts[n] for n in chosen) + ")"
