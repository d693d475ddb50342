"""The simulated phone's tasks: seeded starting states and validators that read the phone's state.

Validators live beside the tasks because they read ``PhoneState`` directly; ``run_validators``
turns their verdicts into the genv ``result`` object (weighted score, overall success, one entry
per validator) and the gym only wraps it in the answer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from cua_rl.sim.phone import NOTE_POOL, PhoneState

Check = Callable[[PhoneState, str | None], tuple[bool, str]]


@dataclass(frozen=True)
class Validator:
    id: str
    weight: float
    check: Check
    # Whether the check reads the final answer (a task whose validators read none cannot be
    # answered "infeasible": the audit's claim-infeasible agent skips it).
    reads_answer: bool = False


@dataclass(frozen=True)
class SimTask:
    number: int
    name: str
    difficulty: str
    app: str
    description: str
    setup: Callable[[PhoneState], None]
    validators: tuple[Validator, ...]
    # A known solution in the agent's action language (``tap(300, 116)``, ``finished("111")``),
    # the oracle the audit replays (docs/audit.md); tasks from a task file may give one.
    solution: tuple[str, ...] = ()
    # The id a task file gave; empty: ``sim-NNN-name``.
    given_id: str = ""

    @property
    def task_id(self) -> str:
        return self.given_id or f"sim-{self.number:03d}-{self.name.replace('_', '-')}"

    @property
    def reads_answer(self) -> bool:
        return any(v.reads_answer for v in self.validators)


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


def _answer_from_calculator(value: str) -> Check:
    """The answer states ``value`` and the calculator shows it: an answer computed elsewhere (the
    instruction gives the sum away) earns nothing. The audit found the plain answer check paying
    half the task's reward for answering at once, with no action (docs/gym.md)."""
    stated = _answer(value)

    def check(s: PhoneState, a: str | None) -> tuple[bool, str]:
        ok, msg = stated(s, a)
        if ok and s.calc_result != value:
            return False, f"{msg}, but the calculator shows {s.calc_result!r}, not {value!r}"
        return ok, msg

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
        (
            V("calculator_result", 1, _calc("111")),
            V("answer", 1, _answer_from_calculator("111"), True),
        ),
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

# Each task's known solution on the 360x640 design grid (the backend scales it to its screen),
# in the agent's action language: the oracle the audit replays (docs/audit.md). Points: the home
# screen's icons at (70, 130) Settings, (180, 130) Notes, (290, 130) Calculator; on Settings the
# Wi-Fi switch (300, 116), the Bluetooth switch (300, 186), the brightness track at y = 290 from
# x = 30 (0%) to 330 (100%); on Notes "+ New" (305, 50), in the editor Save (280, 345); the
# calculator's keys on a 86 x 90 grid from (51, 239).
_SETTINGS, _NOTES, _CALCULATOR = "tap(70, 130)", "tap(180, 130)", "tap(290, 130)"
_WIFI, _BLUETOOTH = "tap(300, 116)", "tap(300, 186)"
_CALC_KEYS = {
    k: f"tap({51 + 86 * c}, {239 + 90 * r})"
    for r, row in enumerate(("789/", "456*", "123-", "C0=+"))
    for c, k in enumerate(row)
}


def _note(text: str) -> tuple[str, ...]:
    return ("tap(305, 50)", f'type("{text}")', "tap(280, 345)")


def _keys(seq: str) -> tuple[str, ...]:
    return tuple(_CALC_KEYS[k] for k in seq)


SOLUTIONS: dict[int, tuple[str, ...]] = {
    1: (_SETTINGS, _WIFI),
    2: (_SETTINGS, _WIFI),
    3: (_SETTINGS, _BLUETOOTH),
    4: (_CALCULATOR,),
    5: (_SETTINGS, "swipe(120, 290, 359, 290)"),
    6: (_SETTINGS, "tap(180, 290)"),
    7: (_NOTES, *_note("buy milk")),
    8: (_CALCULATOR, *_keys("12+7=")),
    9: (_SETTINGS, _WIFI, _BLUETOOTH),
    10: (_SETTINGS, _WIFI, _BLUETOOTH, "tap(60, 290)"),
    11: (_NOTES, *_note("alpha"), *_note("beta")),
    # The starting notes are "keep me", "old plan", "shopping": rows at y = 112, 168, 224.
    12: (_NOTES, "tap(320, 168)"),
    13: (_CALCULATOR, *_keys("37*3="), 'finished("111")'),
    14: ("tap(300, 106)",),
    15: ("tap(300, 106)",),
    16: ("tap(300, 106)",),
    17: ("tap(300, 106)", "tap(300, 106)"),
    18: ("tap(300, 106)", "tap(300, 106)"),
    19: ("tap(270, 96)",),
    20: ("tap(306, 96)",),
    # The setup wizard: Next, the middle band (y 213-427), on each of its 4 pages.
    21: ("tap(180, 320)",) * 4,
    22: ("tap(180, 320)",) * 4,
}
TASKS = tuple(replace(t, solution=SOLUTIONS[t.number]) for t in TASKS)
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
