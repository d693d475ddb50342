"""MiniWoB++ tasks as the browser backend serves them: the catalogue, page control and rewards.

The task pages come from Farama's ``miniwob`` wheel (installed with ``--no-deps``: only its HTML,
JavaScript and environment list are read; its Selenium environment is never imported). The
catalogue is the wheel's list of registered environments, read from the source of
``miniwob/envs/miniwob_envs.py`` without importing it: each class names its page
(``subdomain``) and describes the task in its docstring.

Every page holds one task whose problem ``genProblem()`` draws from ``Math.random``; MiniWoB's
``core.js`` brings a seedable generator, a per-episode timer (``core.EPISODE_MAX_TIME``) and the
reward globals its own reward function sets (``WOB_RAW_REWARD_GLOBAL`` in [-1, 1],
``WOB_REWARD_GLOBAL`` discounted by the time taken, ``WOB_DONE_GLOBAL``). ``START_JS`` seeds the
generator, sets the timer and starts the episode; it also makes the end of that first episode
final: ``core.js`` would otherwise show its "START" cover, and the next click on it would draw a
new problem and reset the rewards. It hides MiniWoB's reward display and click trace (panels for
people, right of the task area): with them the page is wider than the task area, and a page that
focuses an element (click-dialog's dialog) scrolls the task out of the screenshot.

Tags are a task's difficulty and family. The difficulty is this project's rough grouping, not
MiniWoB's: ``easy`` is one click on what the instruction names, ``hard`` is dragging, drawing,
timing or a long multi-screen flow, ``normal`` is the rest. The family is the first word of the
task's name (click, enter, drag, email, use, ...).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from cua_rl.errors import ConfigError

# The task area of every MiniWoB page (core.css: #wrap is 160x210 CSS pixels at the top left).
TASK_WIDTH, TASK_HEIGHT = 160, 210
REWARD_MODES = ("raw", "discounted", "binary")
EASY = frozenset(
    "click-button click-color click-dialog click-dialog-2 click-link click-shape click-tab "
    "click-test click-test-2 click-test-transfer click-widget focus-text focus-text-2 "
    "identify-shape".split()
)
HARD_FAMILIES = ("drag", "draw", "email", "book", "social", "copy", "highlight")
HARD = frozenset(
    "chase-circle moving-items simon-says tic-tac-toe use-colorwheel use-colorwheel-2 hot-cold "
    "guess-number stock-market daily-calendar search-engine terminal text-editor navigate-tree "
    "click-scroll-list resize-textarea scroll-text scroll-text-2 form-sequence-2 "
    "form-sequence-3 multi-layouts multi-orderings order-food phone-book bisect-angle "
    "circle-center right-angle click-checkboxes-large number-checkboxes".split()
)

START_JS = """([seed, maxMs]) => {
  const hud = document.createElement('style');
  hud.textContent = '#reward-display, #click-canvas { display: none !important; }';
  document.head.appendChild(hud);
  Math.seedrandom(seed);
  core.EPISODE_MAX_TIME = maxMs;
  core.startEpisodeReal();
  core.startEpisode = function () {};
  return core.getUtterance();
}"""
READY_JS = "() => typeof WOB_TASK_READY === 'undefined' || WOB_TASK_READY === true"
STATE_JS = """() => {
  const wrap = document.getElementById('wrap') || document.body;
  const values = Array.from(wrap.querySelectorAll('input, textarea, select')).map(
    e => (e.type === 'checkbox' || e.type === 'radio') ? String(e.checked) : e.value);
  return wrap.innerHTML + '\u0000' + values.join('\u0001');
}"""
STATE_JS = """() => ({done: WOB_DONE_GLOBAL, raw: WOB_RAW_REWARD_GLOBAL,
  reward: WOB_REWARD_GLOBAL, reason: WOB_REWARD_REASON, utterance: core.getUtterance()})"""
# The page's state as the task sees it, hashed: the task area's markup, what its form controls
# hold (values, checks and selections live outside the markup), scroll offsets, the focused
# element, the text selection and the reward globals. Two equal keys: nothing the task can read
# changed. 32-bit FNV-1a over the UTF-16 code units, with the text's length.
STATE_KEY_JS = """() => {
  const wrap = document.getElementById('wrap') || document.body;
  const parts = [wrap.innerHTML];
  for (const el of wrap.querySelectorAll('input, textarea, select')) {
    parts.push(el.value, el.checked ? '1' : '0', String(el.selectedIndex));
  }
  for (const el of wrap.querySelectorAll('*')) {
    if (el.scrollTop || el.scrollLeft) parts.push(el.scrollTop + ',' + el.scrollLeft);
  }
  const active = document.activeElement;
  parts.push(active ? active.tagName + '#' + active.id + '.' + active.className : '');
  parts.push(String(window.getSelection()));
  parts.push(String(WOB_DONE_GLOBAL), String(WOB_RAW_REWARD_GLOBAL));
  const text = parts.join('\u0001');
  let h = 0x811c9dc5;
  for (let i = 0; i < text.length; i++) {
    h ^= text.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return text.length + ':' + h.toString(16);
}"""


@dataclass(frozen=True)
class MiniWobTask:
    number: int
    name: str
    description: str
    page: Path

    @property
    def task_id(self) -> str:
        return f"miniwob-{self.name}"

    @property
    def family(self) -> str:
        return self.name.split("-", 1)[0]

    @property
    def difficulty(self) -> str:
        if self.name in EASY:
            return "easy"
        if self.name in HARD or self.family in HARD_FAMILIES:
            return "hard"
        return "normal"

    @property
    def instruction(self) -> str:
        return (
            f"{self.description} The exact instruction is in the yellow box at the top of the page."
        )


def package_root() -> Path:
    """The installed ``miniwob`` distribution's package folder, found from its metadata without
    importing it (a module named ``miniwob`` on sys.path, such as bench/miniwob.py, is not it)."""
    try:
        root = Path(str(importlib.metadata.distribution("miniwob").locate_file("miniwob")))
    except importlib.metadata.PackageNotFoundError:
        root = None
    if root is None or not (root / "html" / "miniwob").is_dir():
        raise ConfigError(
            "the browser gym needs the MiniWoB++ task pages: pip install --no-deps miniwob==1.1.0 "
            "(the Makefile's `make venv` installs it)"
        )
    return root


@cache
def catalogue(root: Path | None = None) -> tuple[MiniWobTask, ...]:
    """Every registered MiniWoB task whose page the wheel ships, numbered by name from 1."""
    root = root or package_root()
    source = (root / "envs" / "miniwob_envs.py").read_text()
    found = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        name = _subdomain(node)
        page = root / "html" / "miniwob" / f"{name}.html"
        if name and page.is_file():
            found.append((name, _description(ast.get_docstring(node) or ""), page))
    found.sort()
    return tuple(MiniWobTask(i + 1, n, d, p) for i, (n, d, p) in enumerate(found))


def _subdomain(node: ast.ClassDef) -> str | None:
    for stmt in node.body:
        if (
            isinstance(stmt, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "subdomain" for t in stmt.targets)
            and isinstance(stmt.value, ast.Constant)
        ):
            return str(stmt.value.value)
    return None


def _description(doc: str) -> str:
    match = re.search(r"## Description\s*\n(.*?)(?:\n## |\Z)", doc, re.S)
    return " ".join((match.group(1) if match else doc).split())


def select(names: list[str] | tuple[str, ...]) -> tuple[MiniWobTask, ...]:
    """The catalogue, or the tasks named (by name or task id); unknown names are an error."""
    tasks = catalogue()
    if not names:
        return tasks
    by_name = {t.name: t for t in tasks} | {t.task_id: t for t in tasks}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ConfigError(
            f"unknown MiniWoB tasks {unknown}; known: {', '.join(t.name for t in tasks)}"
        )
    return tuple(dict.fromkeys(by_name[n] for n in names))


def score(state: dict, mode: str) -> float:
    """The genv score of a page's reward state under ``mode`` (see ``REWARD_MODES``)."""
    if mode == "raw":
        return float(state["raw"])
    if mode == "discounted":
        return float(state["reward"])
    return 1.0 if state["raw"] > 0 else 0.0


def result(state: dict, mode: str) -> dict:
    """The genv ``result`` object: the mapped score, MiniWoB's success (a positive raw reward),
    one validator, and the page's own reward state kept under ``miniwob``."""
    ok = bool(state["done"]) and state["raw"] > 0
    value = score(state, mode)
    if state["done"]:
        message = f"the page's reward function gave {state['raw']:g} (reason {state['reason']!r})"
    else:
        message = "the episode has not ended: no reward yet"
    return {
        "score": value,
        "success": ok,
        "validators": [
            {
                "id": "miniwob_reward",
                "pass": ok,
                "score": value,
                "weight": 1.0,
                "message": message,
            }
        ],
        "miniwob": {
            "done": bool(state["done"]),
            "raw_reward": float(state["raw"]),
            "reward": float(state["reward"]),
            "reason": state["reason"],
            "utterance": state["utterance"],
            "reward_mode": mode,
        },
    }
