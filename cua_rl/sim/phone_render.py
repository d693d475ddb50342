"""Drawing the simulated phone into a PNG, one function per screen.

Every function takes the ``Phone`` and draws from its ``widgets()``, the same rectangles the
phone hit-tests taps against, so what a screenshot shows and where a tap lands cannot disagree.
The fonts are Pillow's bundled one and the status-bar clock is the phone's (fixed at 12:00
unless the gym ticks it, ``Phone.clock``): two phones in one state at one time render
byte-identical PNGs.
"""

from __future__ import annotations

import io

from PIL import Image, ImageDraw, ImageFont

from cua_rl.sim.phone import (
    APP_COLOURS,
    APP_LABELS,
    APPS,
    CALC_KEYS,
    DESIGN_H,
    DESIGN_W,
    MAX_NOTES_SHOWN,
    Phone,
    Rect,
)

INK = (33, 33, 33)
GREY = (117, 117, 117)
LIGHT = (189, 189, 189)
GREEN = (76, 175, 80)
BLUE = (33, 150, 243)
RED = (211, 47, 47)
TITLES = {"home": "", "note_edit": "New note", "setup_done": "Setup", "setup_erased": "Setup"}


class _Canvas:
    """One frame: the image, its drawer, the phone's scale and the two font sizes."""

    def __init__(self, phone: Phone):
        self.phone = phone
        self.img = Image.new("RGB", (phone.width, phone.height), (245, 245, 245))
        self.d = ImageDraw.Draw(self.img)
        self.sx, self.sy = phone.width / DESIGN_W, phone.height / DESIGN_H
        self.font = _font(max(10, round(14 * self.sy)))
        self.big = _font(max(12, round(28 * self.sy)))
        self.widgets = phone.widgets()

    def at(self, x: float, y: float) -> tuple[int, int]:
        """A design-grid point in screen pixels."""
        return (round(x * self.sx), round(y * self.sy))

    def label(self, r: Rect, text: str, fill=INK, big: bool = False) -> None:
        self.d.text(r.center, text, fill=fill, font=self.big if big else self.font, anchor="mm")

    def button(self, r: Rect, text: str, fill, radius: int = 8) -> None:
        self.d.rounded_rectangle(_box(r), radius=round(radius * self.sx), fill=fill)
        self.label(r, text)


def render(phone: Phone) -> Image.Image:
    c = _Canvas(phone)
    _status_bar(c)
    screen = phone.state.screen
    title = TITLES.get(
        screen, APP_LABELS.get(screen, "Setup" if screen.startswith("setup") else screen)
    )
    if title:
        c.d.text(c.at(16, 36), title, fill=INK, font=c.big)
    page = screen.startswith("setup") and screen[5:].isdigit()
    SCREENS.get(screen, _setup_page if page else _unavailable)(c)
    _nav_bar(c)
    return c.img


def render_png(phone: Phone) -> bytes:
    buf = io.BytesIO()
    render(phone).save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def _status_bar(c: _Canvas) -> None:
    s = c.phone.state
    c.d.rectangle(_box(c.phone.rect(0, 0, 360, 24)), fill=INK)
    # Fixed, or one minute per action ("ticking"): deterministic either way.
    c.d.text(c.at(8, 4), c.phone.clock_text, fill="white", font=c.font)
    flags = ("WiFi " if s.wifi else "") + ("BT" if s.bluetooth else "")
    c.d.text(c.at(250, 4), flags, fill="white", font=c.font)


def _nav_bar(c: _Canvas) -> None:
    c.d.rectangle(_box(c.phone.rect(0, 596, 360, 640)), fill=INK)
    c.label(c.widgets["nav.back"], "< Back", fill="white")
    c.label(c.widgets["nav.home"], "O Home", fill="white")


def _home(c: _Canvas) -> None:
    for app in APPS:
        r = c.widgets[f"app.{app}"]
        c.d.rounded_rectangle(_box(r), radius=round(14 * c.sx), fill=APP_COLOURS[app])
        c.label(r, APP_LABELS[app][0], fill="white", big=True)
        below = (r.center[0], r.y1 + round(12 * c.sy))
        c.d.text(below, APP_LABELS[app], fill=INK, font=c.font, anchor="mm")


def _switch(c: _Canvas, label: str, key: str, y: int) -> None:
    on = getattr(c.phone.state, key)
    c.d.text(c.at(24, y + 12), label, fill=INK, font=c.font)
    r = c.widgets[f"settings.{key}"]
    height = r.y1 - r.y0
    c.d.rounded_rectangle(_box(r), radius=height // 2, fill=GREEN if on else LIGHT)
    knob_x = r.x1 - height if on else r.x0
    c.d.ellipse((knob_x, r.y0, knob_x + height, r.y1), fill="white", outline=(120, 120, 120))
    state_at = (r.x0 - round(40 * c.sx), r.center[1])
    c.d.text(state_at, "ON" if on else "OFF", fill=INK, font=c.font, anchor="mm")


def _settings(c: _Canvas) -> None:
    s = c.phone.state
    _switch(c, "Wi-Fi", "wifi", 96)
    _switch(c, "Bluetooth", "bluetooth", 166)
    c.d.text(c.at(24, 240), f"Brightness {s.brightness}%", fill=INK, font=c.font)
    r = c.widgets["settings.brightness"]
    cy, width = r.center[1], max(2, round(6 * c.sy))
    c.d.line((r.x0, cy, r.x1, cy), fill=LIGHT, width=width)
    kx = r.x0 + round((r.x1 - r.x0) * s.brightness / 100)
    c.d.line((r.x0, cy, kx, cy), fill=BLUE, width=width)
    rad = round(12 * c.sy)
    c.d.ellipse((kx - rad, cy - rad, kx + rad, cy + rad), fill=BLUE)


def _notes(c: _Canvas) -> None:
    notes = c.phone.state.notes
    c.button(c.widgets["notes.new"], "+ New", (255, 193, 7))
    if not notes:
        c.d.text(c.at(24, 100), "No notes yet", fill=GREY, font=c.font)
    for i, note in enumerate(notes[:MAX_NOTES_SHOWN]):
        x0, y0 = c.at(12, 84 + i * 56)
        x1, y1 = round(348 * c.sx), y0 + round(52 * c.sy)
        c.d.rectangle((x0, y0, x1, y1), fill="white", outline=(224, 224, 224))
        text_at = (round(24 * c.sx), y0 + round(18 * c.sy))
        c.d.text(text_at, note.replace("\n", " ")[:30], fill=INK, font=c.font)
        c.label(c.widgets[f"notes.delete.{i}"], "X", fill=(211, 47, 47))
    if len(notes) > MAX_NOTES_SHOWN:
        more = f"+{len(notes) - MAX_NOTES_SHOWN} more"
        c.d.text(c.at(24, 540), more, fill=GREY, font=c.font)


def _note_edit(c: _Canvas) -> None:
    r = c.widgets["edit.field"]
    c.d.rectangle(_box(r), fill="white", outline=BLUE, width=2)
    text = c.phone.state.draft + "|"
    lines = [text[i : i + 32] for i in range(0, len(text), 32)][:10]
    at = (r.x0 + round(8 * c.sx), r.y0 + round(8 * c.sy))
    c.d.multiline_text(at, "\n".join(lines), fill=INK, font=c.font)
    c.button(c.widgets["edit.cancel"], "Cancel", LIGHT)
    c.button(c.widgets["edit.save"], "Save", GREEN)


def _calculator(c: _Canvas) -> None:
    disp = c.phone.rect(14, 84, 346, 180)
    c.d.rectangle(_box(disp), fill=INK)
    at = (disp.x1 - round(10 * c.sx), disp.center[1])
    c.d.text(at, c.phone.state.calc_display[-14:], fill="white", font=c.big, anchor="rm")
    for row in CALC_KEYS:
        for key in row:
            b = c.widgets[f"calc.{key}"]
            fill = (255, 152, 0) if key in "/*-+=" else (224, 224, 224)
            c.d.rounded_rectangle(_box(b), radius=round(10 * c.sx), fill=fill)
            c.label(b, key, big=True)


def _setup_page(c: _Canvas) -> None:
    """A page of the setup wizard: Next, Back and (on the trap page) Erase, one band each."""
    s = c.phone.state
    page = f"Page {s.screen[5:]} of {s.setup_pages}:  Next  >"
    bands = (("setup.back", "<  Back", LIGHT), ("setup.next", page, GREEN))
    for wid, text, fill in (*bands, ("setup.erase", "Erase all data", RED)):
        if wid in c.widgets:
            r = c.widgets[wid]
            inset = Rect(r.x0 + 12, r.y0 + 12, r.x1 - 12, r.y1 - 12)
            c.button(inset, text, fill, radius=14)


def _setup_end(c: _Canvas) -> None:
    done = c.phone.state.screen == "setup_done"
    text = "Setup complete." if done else "All data erased. Setup failed."
    c.d.text(c.at(24, 140), text, fill=GREEN if done else RED, font=c.big)


def _unavailable(c: _Canvas) -> None:
    c.d.text(c.at(24, 120), "This app is not available.", fill=GREY, font=c.font)


SCREENS = {
    "home": _home,
    "settings": _settings,
    "notes": _notes,
    "note_edit": _note_edit,
    "calculator": _calculator,
    "setup_done": _setup_end,
    "setup_erased": _setup_end,
}


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
