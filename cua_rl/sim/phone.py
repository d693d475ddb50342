"""A small simulated phone: state, touch/keyboard semantics, PNG rendering and its tasks.

The phone is a plain object with no I/O so the gym server, tests and demos drive the same code.
Layout is defined once on a 360x640 design grid and scaled to the configured screen size, so
hit-testing and rendering can never disagree about where a widget is. Everything that varies
between executions (toggles, brightness, pre-existing notes) comes from a ``random.Random``
seeded with ``(seed, task_id)``: two executions of one task under one seed start identical and
render byte-identical screenshots, which is what a GRPO group of samples needs.

Tasks live here too because their validators read the phone's state directly; the gym only
turns their verdicts into the genv answer shape.
"""

from __future__ import annotations

import io
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from PIL import Image, ImageDraw, ImageFont

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


class ActionError(ValueError):
    """A malformed action (unknown name, bad or missing arguments): the gym answers 400."""


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


class Phone:
    """One simulated device. ``act`` mutates it; ``render_png`` draws it."""

    def __init__(self, state: PhoneState, width: int = DESIGN_W, height: int = DESIGN_H):
        if width < 120 or height < 200:
            raise ValueError(f"screen {width}x{height} is too small; use at least 120x200")
        self.state = state
        self.width = width
        self.height = height
        self._sx = width / DESIGN_W
        self._sy = height / DESIGN_H

    # -- layout ---------------------------------------------------------------------------
    def _r(self, x0: int, y0: int, x1: int, y1: int) -> Rect:
        return Rect(
            round(x0 * self._sx), round(y0 * self._sy), round(x1 * self._sx), round(y1 * self._sy)
        )

    def widgets(self) -> dict[str, Rect]:
        """Tappable widgets of the current screen, by id, in screen pixels."""
        s = self.state.screen
        w: dict[str, Rect] = {
            "nav.back": self._r(0, 596, 180, 640),
            "nav.home": self._r(180, 596, 360, 640),
        }
        if s == "home":
            for i, app in enumerate(APPS):
                col, row = i % 3, i // 3
                x0, y0 = 30 + col * 110, 90 + row * 130
                w[f"app.{app}"] = self._r(x0, y0, x0 + 80, y0 + 80)
        elif s == "settings":
            w["settings.wifi"] = self._r(260, 96, 340, 136)
            w["settings.bluetooth"] = self._r(260, 166, 340, 206)
            w["settings.brightness"] = self._r(30, 270, 330, 310)
        elif s == "notes":
            w["notes.new"] = self._r(260, 32, 350, 68)
            for i, _ in enumerate(self.state.notes[:MAX_NOTES_SHOWN]):
                y0 = 84 + i * 56
                w[f"notes.delete.{i}"] = self._r(296, y0 + 8, 344, y0 + 48)
        elif s == "note_edit":
            w["edit.field"] = self._r(20, 90, 340, 300)
            w["edit.cancel"] = self._r(20, 320, 140, 370)
            w["edit.save"] = self._r(220, 320, 340, 370)
        elif s == "calculator":
            for r, row in enumerate(CALC_KEYS):
                for c, key in enumerate(row):
                    x0, y0 = 14 + c * 86, 200 + r * 90
                    w[f"calc.{key}"] = self._r(x0, y0, x0 + 74, y0 + 78)
        return w

    def slider_value(self, x: float) -> int:
        track = self._r(30, 270, 330, 310)
        frac = (x - track.x0) / max(1, track.x1 - track.x0)
        return max(0, min(100, round(frac * 100)))

    # -- actions --------------------------------------------------------------------------
    def act(self, name: str, args: dict) -> str | None:
        """Apply one action. Returns ``None`` on success or a reason the action had no effect.

        Raises ``ActionError`` for malformed actions (the caller's bug, not the agent's miss).
        """
        if not isinstance(args, dict):
            raise ActionError("args must be an object")
        handler = getattr(self, f"_do_{name}", None) if isinstance(name, str) else None
        if handler is None:
            raise ActionError(
                f"unknown action {name!r}; use one of tap, swipe, type, key, back, home, wait"
            )
        return handler(args)

    def _coord(self, args: dict, key: str) -> float:
        v = args.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ActionError(f"argument {key!r} must be a number of screenshot pixels")
        limit = self.width if key.startswith("x") else self.height
        if not 0 <= v < limit:
            raise ActionError(
                f"argument {key}={v} is outside the {self.width}x{self.height} screen"
            )
        return float(v)

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
        text = args.get("text")
        if not isinstance(text, str):
            raise ActionError("argument 'text' must be a string")
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
        secs = args.get("seconds", 1)
        if isinstance(secs, bool) or not isinstance(secs, int | float) or secs < 0:
            raise ActionError("argument 'seconds' must be a non-negative number")
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

    # -- rendering ------------------------------------------------------------------------
    def render(self) -> Image.Image:
        s = self.state
        img = Image.new("RGB", (self.width, self.height), (245, 245, 245))
        d = ImageDraw.Draw(img)
        font = _font(max(10, round(14 * self._sy)))
        big = _font(max(12, round(28 * self._sy)))
        # Status bar: the clock is fixed so screenshots stay deterministic.
        d.rectangle(_box(self._r(0, 0, 360, 24)), fill=(33, 33, 33))
        d.text((round(8 * self._sx), round(4 * self._sy)), "12:00", fill="white", font=font)
        flags = ("WiFi " if s.wifi else "") + ("BT" if s.bluetooth else "")
        d.text((round(250 * self._sx), round(4 * self._sy)), flags, fill="white", font=font)
        title = {
            "home": "",
            "settings": "Settings",
            "notes": "Notes",
            "note_edit": "New note",
            "calculator": "Calculator",
        }.get(s.screen, APP_LABELS.get(s.screen, s.screen))
        if title:
            d.text((round(16 * self._sx), round(36 * self._sy)), title, fill=(33, 33, 33), font=big)
        widgets = self.widgets()
        if s.screen == "home":
            for app in APPS:
                r = widgets[f"app.{app}"]
                d.rounded_rectangle(_box(r), radius=round(14 * self._sx), fill=APP_COLOURS[app])
                d.text(
                    (r.center[0], r.center[1]),
                    APP_LABELS[app][0],
                    fill="white",
                    font=big,
                    anchor="mm",
                )
                d.text(
                    (r.center[0], r.y1 + round(12 * self._sy)),
                    APP_LABELS[app],
                    fill=(33, 33, 33),
                    font=font,
                    anchor="mm",
                )
        elif s.screen == "settings":
            for label, key, y in (("Wi-Fi", "wifi", 96), ("Bluetooth", "bluetooth", 166)):
                on = getattr(s, key)
                d.text(
                    (round(24 * self._sx), round((y + 12) * self._sy)),
                    label,
                    fill=(33, 33, 33),
                    font=font,
                )
                r = widgets[f"settings.{key}"]
                d.rounded_rectangle(
                    _box(r),
                    radius=(r.y1 - r.y0) // 2,
                    fill=(76, 175, 80) if on else (189, 189, 189),
                )
                knob_x = r.x1 - (r.y1 - r.y0) if on else r.x0
                d.ellipse(
                    (knob_x, r.y0, knob_x + (r.y1 - r.y0), r.y1),
                    fill="white",
                    outline=(120, 120, 120),
                )
                d.text(
                    (r.x0 - round(40 * self._sx), r.center[1]),
                    "ON" if on else "OFF",
                    fill=(33, 33, 33),
                    font=font,
                    anchor="mm",
                )
            d.text(
                (round(24 * self._sx), round(240 * self._sy)),
                f"Brightness {s.brightness}%",
                fill=(33, 33, 33),
                font=font,
            )
            r = widgets["settings.brightness"]
            cy = r.center[1]
            d.line((r.x0, cy, r.x1, cy), fill=(189, 189, 189), width=max(2, round(6 * self._sy)))
            kx = r.x0 + round((r.x1 - r.x0) * s.brightness / 100)
            d.line((r.x0, cy, kx, cy), fill=(33, 150, 243), width=max(2, round(6 * self._sy)))
            rad = round(12 * self._sy)
            d.ellipse((kx - rad, cy - rad, kx + rad, cy + rad), fill=(33, 150, 243))
        elif s.screen == "notes":
            r = widgets["notes.new"]
            d.rounded_rectangle(_box(r), radius=round(8 * self._sx), fill=(255, 193, 7))
            d.text(r.center, "+ New", fill=(33, 33, 33), font=font, anchor="mm")
            if not s.notes:
                d.text(
                    (round(24 * self._sx), round(100 * self._sy)),
                    "No notes yet",
                    fill=(117, 117, 117),
                    font=font,
                )
            for i, note in enumerate(s.notes[:MAX_NOTES_SHOWN]):
                y0 = round((84 + i * 56) * self._sy)
                d.rectangle(
                    (round(12 * self._sx), y0, round(348 * self._sx), y0 + round(52 * self._sy)),
                    fill="white",
                    outline=(224, 224, 224),
                )
                d.text(
                    (round(24 * self._sx), y0 + round(18 * self._sy)),
                    note.replace("\n", " ")[:30],
                    fill=(33, 33, 33),
                    font=font,
                )
                dr = widgets[f"notes.delete.{i}"]
                d.text(dr.center, "X", fill=(211, 47, 47), font=font, anchor="mm")
            if len(s.notes) > MAX_NOTES_SHOWN:
                d.text(
                    (round(24 * self._sx), round(540 * self._sy)),
                    f"+{len(s.notes) - MAX_NOTES_SHOWN} more",
                    fill=(117, 117, 117),
                    font=font,
                )
        elif s.screen == "note_edit":
            r = widgets["edit.field"]
            d.rectangle(_box(r), fill="white", outline=(33, 150, 243), width=2)
            text = s.draft + "|"
            lines = [text[i : i + 32] for i in range(0, len(text), 32)][:10]
            d.multiline_text(
                (r.x0 + round(8 * self._sx), r.y0 + round(8 * self._sy)),
                "\n".join(lines),
                fill=(33, 33, 33),
                font=font,
            )
            for wid, label, colour in (
                ("edit.cancel", "Cancel", (189, 189, 189)),
                ("edit.save", "Save", (76, 175, 80)),
            ):
                b = widgets[wid]
                d.rounded_rectangle(_box(b), radius=round(8 * self._sx), fill=colour)
                d.text(b.center, label, fill=(33, 33, 33), font=font, anchor="mm")
        elif s.screen == "calculator":
            disp = self._r(14, 84, 346, 180)
            d.rectangle(_box(disp), fill=(33, 33, 33))
            d.text(
                (disp.x1 - round(10 * self._sx), disp.center[1]),
                s.calc_display[-14:],
                fill="white",
                font=big,
                anchor="rm",
            )
            for row in CALC_KEYS:
                for key in row:
                    b = widgets[f"calc.{key}"]
                    fill = (255, 152, 0) if key in "/*-+=" else (224, 224, 224)
                    d.rounded_rectangle(_box(b), radius=round(10 * self._sx), fill=fill)
                    d.text(b.center, key, fill=(33, 33, 33), font=big, anchor="mm")
        else:
            d.text(
                (round(24 * self._sx), round(120 * self._sy)),
                "This app is not available.",
                fill=(117, 117, 117),
                font=font,
            )
        # Navigation bar.
        nav = self._r(0, 596, 360, 640)
        d.rectangle(_box(nav), fill=(33, 33, 33))
        d.text(widgets["nav.back"].center, "< Back", fill="white", font=font, anchor="mm")
        d.text(widgets["nav.home"].center, "O Home", fill="white", font=font, anchor="mm")
        return img

    def render_png(self) -> bytes:
        buf = io.BytesIO()
        self.render().save(buf, format="PNG", optimize=False)
        return buf.getvalue()


def _box(r: Rect) -> tuple[int, int, int, int]:
    return (r.x0, r.y0, r.x1 - 1, r.y1 - 1)


_FONTS: dict[int, ImageFont.ImageFont | ImageFont.FreeTypeFont] = {}


def _font(size: int):
    # Pillow's bundled font: no system font lookup, so rendering is the same on every machine.
    if size not in _FONTS:
        try:
            _FONTS[size] = ImageFont.load_default(size=size)
        except TypeError:  # Pillow built without FreeType: the fixed bitmap font
            _FONTS[size] = ImageFont.load_default()
    return _FONTS[size]


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


# -- tasks ----------------------------------------------------------------------------------
Check = Callable[[PhoneState, str | None], tuple[bool, str]]


@dataclass(frozen=True)
class Validator:
    id: str
    weight: float
    check: Check


@dataclass(frozen=True)
class SimTask:
    number: int
    name: str
    difficulty: str
    app: str
    description: str
    setup: Callable[[PhoneState], None]
    validators: tuple[Validator, ...]

    @property
    def task_id(self) -> str:
        return f"sim-{self.number:03d}-{self.name.replace('_', '-')}"


def _is(attr: str, want: object) -> Check:
    def check(s: PhoneState, _a: str | None) -> tuple[bool, str]:
        got = getattr(s, attr)
        return got == want, f"{attr} is {got!r}, want {want!r}"

    return check


def _brightness(lo: int, hi: int) -> Check:
    def check(s: PhoneState, _a: str | None) -> tuple[bool, str]:
        return lo <= s.brightness <= hi, f"brightness is {s.brightness}, want {lo}..{hi}"

    return check


def _has_note(text: str, present: bool = True) -> Check:
    def check(s: PhoneState, _a: str | None) -> tuple[bool, str]:
        found = any(n.strip().lower() == text for n in s.notes)
        verb = "present" if found else "absent"
        return found == present, f"note {text!r} is {verb}"

    return check


def _note_count(n: int) -> Check:
    def check(s: PhoneState, _a: str | None) -> tuple[bool, str]:
        return len(s.notes) == n, f"{len(s.notes)} notes, want {n}"

    return check


def _calc(value: str) -> Check:
    def check(s: PhoneState, _a: str | None) -> tuple[bool, str]:
        return s.calc_result == value, f"calculator result is {s.calc_result!r}, want {value!r}"

    return check


def _answer(value: str) -> Check:
    # The number must stand alone: "111." and "is 111" pass, "1111" does not.
    pattern = re.compile(rf"(?<![\d.]){re.escape(value)}(?![\d]|\.\d)")

    def check(_s: PhoneState, a: str | None) -> tuple[bool, str]:
        ok = a is not None and pattern.search(a.replace(",", "")) is not None
        return ok, f"answer {a!r} {'contains' if ok else 'lacks'} {value!r}"

    return check


def _set(**kw: object) -> Callable[[PhoneState], None]:
    def setup(s: PhoneState) -> None:
        for k, v in kw.items():
            setattr(s, k, list(v) if isinstance(v, list) else v)

    return setup


V = Validator
TASKS: tuple[SimTask, ...] = (
    SimTask(
        1,
        "wifi_on",
        "easy",
        "settings",
        "Turn Wi-Fi on.",
        _set(wifi=False),
        (V("wifi_on", 1, _is("wifi", True)),),
    ),
    SimTask(
        2,
        "wifi_off",
        "easy",
        "settings",
        "Turn Wi-Fi off.",
        _set(wifi=True),
        (V("wifi_off", 1, _is("wifi", False)),),
    ),
    SimTask(
        3,
        "bluetooth_off",
        "easy",
        "settings",
        "Turn Bluetooth off.",
        _set(bluetooth=True),
        (V("bluetooth_off", 1, _is("bluetooth", False)),),
    ),
    SimTask(
        4,
        "open_calculator",
        "easy",
        "calculator",
        "Open the Calculator app.",
        _set(screen="home"),
        (V("calculator_open", 1, _is("screen", "calculator")),),
    ),
    SimTask(
        5,
        "brightness_max",
        "normal",
        "settings",
        "Set the screen brightness to maximum (at least 95%).",
        _set(brightness=30),
        (V("brightness_high", 1, _brightness(95, 100)),),
    ),
    SimTask(
        6,
        "brightness_half",
        "normal",
        "settings",
        "Set the screen brightness to about half (between 40% and 60%).",
        _set(brightness=90),
        (V("brightness_half", 1, _brightness(40, 60)),),
    ),
    SimTask(
        7,
        "note_milk",
        "normal",
        "notes",
        "Create a note that says 'buy milk'.",
        _set(),
        (V("note_saved", 1, _has_note("buy milk")),),
    ),
    SimTask(
        8,
        "calc_add",
        "normal",
        "calculator",
        "Use the Calculator to compute 12+7.",
        _set(),
        (V("calculator_result", 1, _calc("19")),),
    ),
    SimTask(
        9,
        "bluetooth_on_wifi_off",
        "normal",
        "settings",
        "Turn Bluetooth on and Wi-Fi off.",
        _set(wifi=True, bluetooth=False),
        (V("bluetooth_on", 1, _is("bluetooth", True)), V("wifi_off", 1, _is("wifi", False))),
    ),
    SimTask(
        10,
        "quiet_mode",
        "hard",
        "settings",
        "Turn off Wi-Fi and Bluetooth and set the brightness below 20%.",
        _set(wifi=True, bluetooth=True, brightness=70),
        (
            V("wifi_off", 1, _is("wifi", False)),
            V("bluetooth_off", 1, _is("bluetooth", False)),
            V("brightness_low", 2, _brightness(0, 19)),
        ),
    ),
    SimTask(
        11,
        "two_notes",
        "hard",
        "notes",
        "Create two notes: one saying 'alpha' and one saying 'beta'.",
        _set(),
        (V("note_alpha", 1, _has_note("alpha")), V("note_beta", 1, _has_note("beta"))),
    ),
    SimTask(
        12,
        "delete_old_note",
        "hard",
        "notes",
        "Delete the note 'old plan' and keep every other note.",
        _set(notes=["keep me", "old plan", "shopping"]),
        (
            V("old_deleted", 2, _has_note("old plan", present=False)),
            V("others_kept", 1, _note_count(2)),
        ),
    ),
    SimTask(
        13,
        "calc_answer",
        "hard",
        "calculator",
        "Compute 37*3 with the Calculator and give the result as your final answer.",
        _set(),
        (V("calculator_result", 1, _calc("111")), V("answer", 1, _answer("111"))),
    ),
)
# The "learn" family (level "learn"): one tap at the centre of the top-right cell of a 3x3 grid
# over the screen, (300, 106) at 360x640, solves each task in one step. That point is the
# Calculator icon on the home screen and the Wi-Fi switch on the Settings screen, where these
# tasks start. A lenient local agent taps the centre of the grid cell that a reply's first
# character names, so a policy learns these tasks by putting its mass on the first tokens that
# name cell 2, without reading the screen; docs/learning.md gives the chance rate.
LEARN_TASKS: tuple[SimTask, ...] = (
    SimTask(
        14,
        "learn_open_calculator",
        "learn",
        "calculator",
        "Open the Calculator app.",
        _set(screen="home"),
        (V("calculator_open", 1, _is("screen", "calculator")),),
    ),
    SimTask(
        15,
        "learn_wifi_on",
        "learn",
        "settings",
        "Turn Wi-Fi on.",
        _set(screen="settings", wifi=False),
        (V("wifi_on", 1, _is("wifi", True)),),
    ),
    SimTask(
        16,
        "learn_wifi_off",
        "learn",
        "settings",
        "Turn Wi-Fi off.",
        _set(screen="settings", wifi=True),
        (V("wifi_off", 1, _is("wifi", False)),),
    ),
)
TASKS = TASKS + LEARN_TASKS
TASKS_BY_ID = {t.task_id: t for t in TASKS}


def initial_state(task: SimTask, seed: int) -> PhoneState:
    """The seeded starting state for ``task``: random where the task does not care."""
    rng = random.Random(f"{seed}:{task.task_id}")
    s = PhoneState(
        wifi=rng.random() < 0.5,
        bluetooth=rng.random() < 0.5,
        brightness=rng.randrange(10, 91, 5),
        notes=rng.sample(NOTE_POOL, rng.randrange(0, 3)),
    )
    task.setup(s)
    return s


def run_validators(task: SimTask, state: PhoneState, answer_text: str | None) -> dict:
    """The genv ``result`` object: weighted score, overall success and one entry per validator."""
    entries = []
    total = sum(v.weight for v in task.validators)
    got = 0.0
    for v in task.validators:
        ok, msg = v.check(state, answer_text)
        got += v.weight if ok else 0.0
        entries.append(
            {
                "id": v.id,
                "pass": ok,
                "score": 1.0 if ok else 0.0,
                "weight": v.weight,
                "message": msg,
            }
        )
    return {"score": got / total, "success": all(e["pass"] for e in entries), "validators": entries}
