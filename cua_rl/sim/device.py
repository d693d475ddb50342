"""What the local gym drives behind an execution: a device, opened by a backend.

The gym (``cua_rl/sim/gym.py``) owns what every execution has in common: ids, the live cap, idle
expiry, screenshots kept after terminate, injected faults and the HTTP answers. A backend owns
the task catalogue and opens one ``Device`` per execution; the device takes screenshots, applies
actions and evaluates its task. Two backends exist: the simulated phone (``phone_backend``, pure
Python, the default) and a headless Chromium on MiniWoB++ pages (``browser``, optional: only it
needs Playwright and a chromium binary).

Errors a device raises mean different things to the gym: ``ActionError`` is the caller's
malformed action (answered 400, the execution goes on); ``DeviceFailure`` is the device itself
breaking (a renderer crash, a page that stops answering): that execution, and only it, is
failed with the reason, its resources are released, and every later call on it says why.

Whether an action changed the device's state is the device's to say (``state_key``: the phone's
state object, a MiniWoB page's task area and reward globals); the gym compares the keys taken
around each action and puts the answer in the action's reply (``changed``), which the agent loop
keeps in the action's ``rawResult`` (docs/audit.md, *Did an action change the state?*).
"""

from __future__ import annotations

from typing import Protocol

from cua_rl.errors import CuaRlError

BACKENDS = ("phone", "browser")


class ActionError(CuaRlError, ValueError):
    """A malformed action (unknown name, bad or missing arguments): the gym answers 400."""


class DeviceFailure(CuaRlError, RuntimeError):
    """The device behind one execution broke; the message is the reason the gym reports."""


class Device(Protocol):
    """One execution's device. Coordinates in actions are screenshot pixels."""

    width: int
    height: int

    async def screenshot(self) -> bytes:
        """The current screen as PNG bytes of ``width`` x ``height`` pixels."""

    async def act(self, name: str, args: dict) -> str | None:
        """Apply one action: ``None`` when it took effect, else why it had none."""

    async def evaluate(self, answer_text: str | None) -> dict:
        """The genv ``result`` object: ``score``, ``success``, ``validators``."""

    def label(self) -> str:
        """A short state name for the action answer's ``screen`` field."""

    # Optional: ``async def state_key(self) -> str``, the device's state hashed (equal keys,
    # equal states). A device that has it gets ``state_key_before`` / ``state_key_after`` in
    # every action answer (docs/gym.md, *State keys*), and ``changed``, whether the two differ
    # (docs/audit.md); without it the answer says nothing of the action's effect. Both backends
    # have it.

    async def close(self) -> None:
        """Release everything the device holds; safe to call twice."""


class Backend(Protocol):
    """Opens devices for tasks; started with the gym's server and stopped with it."""

    kind: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def entries(self) -> list[dict]:
        """The ``GET /tasks`` list entries."""

    def detail(self, task_id: str) -> dict | None:
        """The richer ``GET /tasks/{id}`` object, ``None`` for an unknown task."""

    async def open(self, task_id: str, seed: int) -> Device:
        """A new device with the task loaded at ``seed`` (the task id is known to exist)."""


def screen_point(args: dict, key: str, width: int, height: int) -> float:
    """The coordinate ``args[key]`` checked against the screenshot's size (x* or y* keys)."""
    v = args.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ActionError(f"argument {key!r} must be a number of screenshot pixels")
    limit = width if key.startswith("x") else height
    if not 0 <= v < limit:
        raise ActionError(f"argument {key}={v} is outside the {width}x{height} screen")
    return float(v)


def check_args(args: object) -> dict:
    if not isinstance(args, dict):
        raise ActionError("args must be an object")
    return args


def wait_seconds(args: dict) -> float:
    secs = args.get("seconds", 1)
    if isinstance(secs, bool) or not isinstance(secs, int | float) or secs < 0:
        raise ActionError("argument 'seconds' must be a non-negative number")
    return float(secs)


def text_arg(args: dict) -> str:
    text = args.get("text")
    if not isinstance(text, str):
        raise ActionError("argument 'text' must be a string")
    return text
