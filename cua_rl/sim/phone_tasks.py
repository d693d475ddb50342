"""The simulated phone's tasks: seeded starting states and validators that read the phone's state.

Validators live beside the tasks because they read ``PhoneState`` directly; ``run_validators``
turns their verdicts into the genv ``result`` object (weighted score, overall success, one entry
per validator) and the gym only wraps it in the answer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from cua_rl.sim.phone import NOTE_POOL, PhoneState

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


def _at_least(attr: str, n: int) -> Check:
    def check(s: PhoneState, _a: str | None) -> tuple[bool, str]:
        got = getattr(s, attr)
        return got >= n, f"{attr} is {got}, want at least {n}"

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


def _wifi_task(number: int, name: str, level: str, *, on: bool) -> SimTask:
    """Turn Wi-Fi on (or off), starting on Settings with it the other way: one tap on the switch."""
    return SimTask(
        number,
        name,
        level,
        "settings",
        f"Turn Wi-Fi {'on' if on else 'off'}.",
        _set(screen="settings", wifi=not on),
        (V("wifi_on" if on else "wifi_off", 1, _is("wifi", on)),),
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
    _wifi_task(15, "learn_wifi_on", "learn", on=True),
    _wifi_task(16, "learn_wifi_off", "learn", on=False),
)
# The "learn2" family (level "learn2"): two taps on the same cell, in two steps. Both tasks start on
# Settings, where the top-right cell's centre, (300, 106) at 360x640, is the Wi-Fi switch (as in
# the learn family) and no other cell's centre does anything: the switch must be flipped twice, so
# Wi-Fi ends as it started. One flip pays half (``flipped``), two the rest (``flipped_back``). One
# tap cannot solve a task, and a policy that names cell 2 on every step solves both, so the
# family needs no screen reading, only both turns trained: a trainer that trains the last turn
# of an episode only never trains the first tap. docs/learning.md gives the chance rates.
LEARN2_TASKS: tuple[SimTask, ...] = (
    SimTask(
        17,
        "learn2_wifi_off_on",
        "learn2",
        "settings",
        "Turn Wi-Fi off, then back on.",
        _set(screen="settings", wifi=True),
        (
            V("flipped", 1, _at_least("wifi_toggles", 1)),
            V("flipped_back", 1, _at_least("wifi_toggles", 2)),
        ),
    ),
    SimTask(
        18,
        "learn2_wifi_on_off",
        "learn2",
        "settings",
        "Turn Wi-Fi on, then back off.",
        _set(screen="settings", wifi=False),
        (
            V("flipped", 1, _at_least("wifi_toggles", 1)),
            V("flipped_back", 1, _at_least("wifi_toggles", 2)),
        ),
    ),
)
# The "learn-hard" family (level "learn-hard"): the learn family's Wi-Fi tasks read through a 10x10
# grid (the agent's ``lenientGrid: 10``, configs/learn-hard.yaml). Two cells' centres, 17 and 18
# ((270, 96) and (306, 96) at 360x640), fall on the Wi-Fi switch; no other cell's centre flips it.
# A uniformly random cell succeeds with 2/100 and a uniformly random first token of the tiny
# BPE vocabulary with about 1/80, so most groups fail entirely: the family replay is measured on
# (docs/learning.md).
LEARN_HARD_TASKS: tuple[SimTask, ...] = (
    _wifi_task(19, "learn_hard_wifi_on", "learn-hard", on=True),
    _wifi_task(20, "learn_hard_wifi_off", "learn-hard", on=False),
)
# The "learn-long" family (level "learn-long"): a setup wizard of 4 pages, 8 steps
# (configs/learn-long.yaml), where step credit is measured (docs/learning.md). On each page the
# middle band (the lenient 3x3 grid's middle row) is Next, the top band Back (a detour: the
# previous page again; on page 1 nothing), the bottom band nothing, except on one page (the trap)
# where it erases everything: a dead end, whatever comes after. Success: the wizard finished
# within the episode. One wrong tap on the trap page decides the outcome; backward and wasted taps
# elsewhere only cost steps, and screens are revisited. Next sits in the middle row because the
# tiny model's first tokens favour it (about 0.52 of its taps, measured): chance then finishes
# about 1 in 3 episodes, where a uniformly random row would 1 in 11 (docs/learning.md); a policy
# naming the middle row on every step always finishes, without reading the screen.
LEARN_LONG_TASKS: tuple[SimTask, ...] = tuple(
    SimTask(
        number,
        f"learn_long_setup_trap{trap}",
        "learn-long",
        "setup",
        "Finish the 4-page setup without erasing your data.",
        _set(screen="setup1", setup_pages=4, setup_trap=trap),
        (V("setup_done", 1, _is("screen", "setup_done")),),
    )
    for number, trap in ((21, 2), (22, 3))
)
TASKS = TASKS + LEARN_TASKS + LEARN2_TASKS + LEARN_HARD_TASKS + LEARN_LONG_TASKS
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
