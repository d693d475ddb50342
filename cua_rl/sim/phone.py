"""A small simulated phone: state, layout and touch/keyboard semantics.

The phone is a plain object with no I/O so the gym server, tests and demos drive the same code;
``phone_render.render_png(phone)`` draws it, ``phone_tasks`` holds its tasks and validators.
Layout is defined once on a 360x640 design grid and scaled to the configured screen size, so
hit-testing and rendering can never disagree about where a widget is. Everything that varies
between executions (toggles, brightness, pre-existing notes) comes from a ``random.Random``
seeded with ``(seed, task_id)``: two executions of one task under one seed start identical and
render byte-identical screenshots, which is what a GRPO group of samples needs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from cua_rl.sim.device import ActionError, check_args, screen_point, text_arg, wait_seconds

DESIGN_W, DESIGN_H = 360, 640
APPS = ("settings", "notes", "calculator", "camera", "clock", "maps")
APP_LABELS = {
    "settings": "Settings",
    "notes": "Notes",
    "calculator": "Calculator",
    "camera": "Camera",
    "clock": "Clock",
    "maps": "Maps",
}
APP_COLOURS = {
    "settings": (96, 125, 139),
    "notes": (255, 193, 7),
    "calculator": (76, 175, 80),
    "camera": (63, 81, 181),
    "clock": (156, 39, 176),
    "maps": (0, 150, 136),
}
CALC_KEYS = ("789/", "456*", "123-", "C0=+")
NOTE_POOL = ("groceries", "call mom", "gym at 6", "pay rent", "book flights", "dentist")
MAX_NOTES_SHOWN = 8
MAX_TEXT = 200
KEYS = ("enter", "backspace", "back", "home", "tab", "escape", "space")
CLOCKS = ("fixed", "ticking")


@dataclass(frozen=True)
class Rect:
    x0: int
    y0: int
    x1: int
    y1: int

    def contains(self, x: float, y: float) -> bool:
        return self.x0 <= x < self.x1 and self.y0 <= y < self.y1

    @property
    def center(self) -> tuple[int, int]:
        return ((self.x0 + self.x1) // 2, (self.y0 + self.y1) // 2)


@dataclass
class PhoneState:
    wifi: bool = False
    bluetooth: bool = False
    brightness: int = 50
    notes: list[str] = field(default_factory=list)
    screen: str = "home"
    draft: str = ""
    calc_display: str = "0"
    calc_result: str | None = None
    # Flips of the Wi-Fi switch in this execution (the learn2 family's validators count them).
    wifi_toggles: int = 0
    # The setup wizard (the learn-long family): pages 1..setup_pages, screens "setup<n>",
    # "setup_done" and "setup_erased"; the page whose bottom band erases everything (0: none).
    setup_pages: int = 4
    setup_trap: int = 0


class Phone:
    """One simulated device. ``act`` mutates it; ``render_png`` draws it."""

    def __init__(
        self,
        state: PhoneState,
        width: int = DESIGN_W,
        height: int = DESIGN_H,
        clock: str = "fixed",
    ):
        if width < 120 or height < 200:
            raise ValueError(f"screen {width}x{height} is too small; use at least 120x200")
        if clock not in CLOCKS:
            raise ValueError(f"clock={clock!r}: use one of {', '.join(CLOCKS)}")
        self.state = state
        self.width = width
        self.height = height
        self._sx = width / DESIGN_W
        self._sy = height / DESIGN_H
        # The status bar's clock is the device's, not the task's: "ticking" moves it a minute
        # per action, as a real phone's would between screenshots; the state key ignores it.
        self.clock = clock
        self.minutes = 0

    @property
    def clock_text(self) -> str:
        m = 12 * 60 + self.minutes
        return f"{m // 60 % 24:02d}:{m % 60:02d}"

    def state_key(self) -> str:
        """The gym's name for the phone's state (docs/gym.md, *State keys*): every field of
        ``PhoneState``, hidden counters included, hashed; equal keys, equal states. The clock is
        not part of it."""
        text = json.dumps(asdict(self.state), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # -- layout ---------------------------------------------------------------------------
    def rect(self, x0: int, y0: int, x1: int, y1: int) -> Rect:
        return Rect(
            round(x0 * self._sx), round(y0 * self._sy), round(x1 * self._sx), round(y1 * self._sy)
        )

    def widgets(self) -> dict[str, Rect]:
        """Tappable widgets of the current screen, by id, in screen pixels."""
        s = self.state.screen
        w: dict[str, Rect] = {
            "nav.back": self.rect(0, 596, 180, 640),
            "nav.home": self.rect(180, 596, 360, 640),
        }
        if s == "home":
            for i, app in enumerate(APPS):
                col, row = i % 3, i // 3
                x0, y0 = 30 + col * 110, 90 + row * 130
                w[f"app.{app}"] = self.rect(x0, y0, x0 + 80, y0 + 80)
        elif s == "settings":
            w["settings.wifi"] = self.rect(260, 96, 340, 136)
            w["settings.bluetooth"] = self.rect(260, 166, 340, 206)
            w["settings.brightness"] = self.rect(30, 270, 330, 310)
        elif s == "notes":
            w["notes.new"] = self.rect(260, 32, 350, 68)
            for i, _ in enumerate(self.state.notes[:MAX_NOTES_SHOWN]):
                y0 = 84 + i * 56
                w[f"notes.delete.{i}"] = self.rect(296, y0 + 8, 344, y0 + 48)
        elif s == "note_edit":
            w["edit.field"] = self.rect(20, 90, 340, 300)
            w["edit.cancel"] = self.rect(20, 320, 140, 370)
            w["edit.save"] = self.rect(220, 320, 340, 370)
        elif s.startswith("setup") and s[5:].isdigit():
            # Three full-width bands: the lenient agent's 3x3 grid rows (top, middle, bottom).
            w["setup.back"] = self.rect(0, 24, 360, 213)
            w["setup.next"] = self.rect(0, 213, 360, 427)
            if int(s[5:]) == self.state.setup_trap:
                w["setup.erase"] = self.rect(0, 427, 360, 596)
        elif s == "calculator":
            for r, row in enumerate(CALC_KEYS):
                for c, key in enumerate(row):
                    x0, y0 = 14 + c * 86, 200 + r * 90
                    w[f"calc.{key}"] = self.rect(x0, y0, x0 + 74, y0 + 78)
        return w

    def slider_value(self, x: float) -> int:
        track = self.rect(30, 270, 330, 310)
        frac = (x - track.x0) / max(1, track.x1 - track.x0)
        return max(0, min(100, round(frac * 100)))

    # -- actions --------------------------------------------------------------------------
    def act(self, name: str, args: dict) -> str | None:
        """Apply one action. Returns ``None`` on success or a reason the action had no effect.

        Raises ``ActionError`` for malformed actions (the caller's bug, not the agent's miss).
        """
        args = check_args(args)
        handler = getattr(self, f"_do_{name}", None) if isinstance(name, str) else None
        if handler is None:
            raise ActionError(
                f"unknown action {name!r}; use one of tap, swipe, type, key, back, home, wait"
            )
        result = handler(args)
        if self.clock == "ticking":
            self.minutes += 1
        return result

    def _coord(self, args: dict, key: str) -> float:
        return screen_point(args, key, self.width, self.height)

    def _do_tap(self, args: dict) -> str | None:
        x, y = self._coord(args, "x"), self._coord(args, "y")
        for wid, rect in self.widgets().items():
            if rect.contains(x, y):
                return self._press(wid, x)
        return f"nothing to tap at ({x:g}, {y:g})"

    def _do_swipe(self, args: dict) -> str | None:
        x1, y1 = self._coord(args, "x1"), self._coord(args, "y1")
        x2, _y2 = self._coord(args, "x2"), self._coord(args, "y2")
        slider = self.widgets().get("settings.brightness")
        if slider is not None and slider.contains(x1, y1):
            self.state.brightness = self.slider_value(min(max(x2, slider.x0), slider.x1))
            return None
        return "swipe had no effect here"

    def _do_type(self, args: dict) -> str | None:
        text = text_arg(args)
        s = self.state
        if s.screen == "note_edit":
            s.draft = (s.draft + text)[:MAX_TEXT]
            return None
        if s.screen == "calculator":
            for ch in text.replace(" ", ""):
                key = "C" if ch in "cC" else ch
                if key not in "".join(CALC_KEYS):
                    return f"calculator has no key {ch!r}"
                self._calc_press(key)
            return None
        return "no text field is focused"

    def _do_key(self, args: dict) -> str | None:
        key = args.get("key")
        if not isinstance(key, str) or key.lower() not in KEYS:
            raise ActionError(f"argument 'key' must be one of {', '.join(KEYS)}")
        key = key.lower()
        if key == "back" or key == "escape":
            return self._do_back({})
        if key == "home":
            return self._do_home({})
        s = self.state
        if s.screen == "note_edit":
            if key == "backspace":
                s.draft = s.draft[:-1]
            elif key == "enter":
                s.draft = (s.draft + "\n")[:MAX_TEXT]
            elif key == "space":
                s.draft = (s.draft + " ")[:MAX_TEXT]
            return None
        if s.screen == "calculator":
            if key == "enter":
                self._calc_press("=")
                return None
            if key == "backspace":
                s.calc_display = s.calc_display[:-1] or "0"
                return None
        return f"key {key!r} had no effect here"

    def _do_back(self, args: dict) -> str | None:
        s = self.state
        if s.screen == "home":
            return "already on the home screen"
        if s.screen == "note_edit":
            s.draft = ""  # leaving the editor without Save discards the draft
            s.screen = "notes"
        else:
            s.screen = "home"
        return None

    def _do_home(self, args: dict) -> str | None:
        if self.state.screen == "note_edit":
            self.state.draft = ""
        self.state.screen = "home"
        return None

    def _do_wait(self, args: dict) -> str | None:
        wait_seconds(args)
        return None  # nothing on the simulated phone changes with time

    def _press(self, wid: str, x: float) -> str | None:
        s = self.state
        if wid == "nav.back":
            return self._do_back({})
        if wid == "nav.home":
            return self._do_home({})
        if wid.startswith("app."):
            s.screen = wid[4:]
            if s.screen == "calculator":
                s.calc_display, s.calc_result = "0", None
            return None
        if wid == "settings.wifi":
            s.wifi = not s.wifi
            s.wifi_toggles += 1
        elif wid == "settings.bluetooth":
            s.bluetooth = not s.bluetooth
        elif wid == "settings.brightness":
            s.brightness = self.slider_value(x)
        elif wid == "notes.new":
            s.screen, s.draft = "note_edit", ""
        elif wid.startswith("notes.delete."):
            del s.notes[int(wid.rsplit(".", 1)[1])]
        elif wid == "edit.cancel":
            s.screen, s.draft = "notes", ""
        elif wid == "edit.save":
            if not s.draft.strip():
                return "cannot save an empty note"
            s.notes.append(s.draft)
            s.screen, s.draft = "notes", ""
        elif wid.startswith("calc."):
            self._calc_press(wid[5:])
        elif wid.startswith("setup."):
            return self._setup_press(wid[6:])
        return None

    def _setup_press(self, band: str) -> str | None:
        s = self.state
        page = int(s.screen[5:])
        if band == "next":
            s.screen = f"setup{page + 1}" if page < s.setup_pages else "setup_done"
        elif band == "erase":
            s.screen = "setup_erased"
        elif page == 1:
            return "already on the first page of the setup"
        else:
            s.screen = f"setup{page - 1}"
        return None

    def _calc_press(self, key: str) -> None:
        s = self.state
        if key == "C":
            s.calc_display, s.calc_result = "0", None
        elif key == "=":
            s.calc_display = s.calc_result = evaluate_expression(s.calc_display)
        else:
            fresh = s.calc_display in ("0", "Error") or s.calc_display == s.calc_result
            if fresh and key.isdigit():
                s.calc_display = key
            else:
                s.calc_display = (s.calc_display + key)[:24]
            s.calc_result = None


def evaluate_expression(expr: str) -> str:
    """Evaluate ``12+7*3``-style input with the usual precedence; ``Error`` if malformed."""
    tokens: list[str] = []
    num = ""
    for ch in expr:
        if ch.isdigit():
            num += ch
        elif ch in "+-*/":
            if not num:
                return "Error"
            tokens += [num, ch]
            num = ""
        else:
            return "Error"
    if not num:
        return "Error"
    tokens.append(num)
    # First pass: * and /, second: + and -.
    stack: list[float | str] = [float(tokens[0])]
    for op, val in zip(tokens[1::2], tokens[2::2], strict=True):
        v = float(val)
        if op == "*":
            stack[-1] = float(stack[-1]) * v
        elif op == "/":
            if v == 0:
                return "Error"
            stack[-1] = float(stack[-1]) / v
        else:
            stack += [op, v]
    total = float(stack[0])
    for op, v in zip(stack[1::2], stack[2::2], strict=True):
        total = total + float(v) if op == "+" else total - float(v)
    if total == int(total):
        return str(int(total))
    return f"{total:.6g}"
