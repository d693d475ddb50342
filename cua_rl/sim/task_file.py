"""Phone tasks a user writes: a YAML file the local gym serves beside its built-in tasks.

``python -m cua_rl.sim gym --task-file my-tasks.yaml`` (repeatable) loads every task of the file
into the phone backend. A task names its app, its instruction, its starting state (fields of
``PhoneState``; the fields it leaves out are drawn from the execution's seed as the built-in
tasks' are) and its validators over the phone's state and the final answer; it may give a known
solution in the agent's action language, the oracle the audit replays (docs/audit.md). The
format is documented in docs/gym.md (*Tasks of your own*).

Validators are declarative (a field compared with a value, a saved note, the answer) or, for
anything else, a Python callable named ``module:function`` taking ``(state, answer_text)`` and
returning ``(passed, message)``. Every mistake is one ``ConfigError`` naming the file, the task
and the key, and the gym does not start.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from cua_rl.agent.actions import ActionParseError, parse_action
from cua_rl.errors import ConfigError
from cua_rl.sim.phone import APPS, PhoneState
from cua_rl.sim.phone_tasks import (
    Check,
    SimTask,
    Validator,
    _answer,
    _at_least,
    _has_note,
    _is,
    _note_count,
)

SCREENS = ("home", "note_edit", *APPS)
STATE_FIELDS = {f.name: f for f in fields(PhoneState)}
_TASK_KEYS = {"name", "id", "number", "description", "app", "level", "start", "validators"}
_TASK_KEYS |= {"solution"}
# One of these says what a validator checks; the comparisons go with ``field``.
_KINDS = ("field", "note", "answer", "python")
_COMPARISONS = ("equals", "at_least", "at_most", "between", "contains", "count")
_VALIDATOR_KEYS = {"id", "weight", "present", *_KINDS, *_COMPARISONS}


class _Where:
    """Names what is being read, for the error messages."""

    def __init__(self, path: Path, task: str = "") -> None:
        self.path, self.task = path, task

    def error(self, message: str) -> ConfigError:
        where = f"{self.path}: task {self.task!r}" if self.task else str(self.path)
        return ConfigError(f"{where}: {message}")


def load_task_file(path: str | Path, first_number: int) -> tuple[SimTask, ...]:
    """The tasks of one YAML file, numbered from ``first_number`` where they give no number."""
    import yaml

    p = Path(path)
    where = _Where(p)
    if not p.is_file():
        raise where.error("no such task file")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise where.error(f"not YAML: {' '.join(str(exc).split())}") from None
    items = data.get("tasks") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise where.error("expected a mapping with a non-empty list under 'tasks:'")
    tasks = []
    for i, item in enumerate(items):
        name = item.get("name") if isinstance(item, dict) else None
        tasks.append(_task(item, _Where(p, str(name or f"#{i + 1}")), first_number + i))
    return tuple(tasks)


def load_task_files(paths: list[str], builtin: tuple[SimTask, ...]) -> tuple[SimTask, ...]:
    """Every file's tasks after ``builtin``: ids and numbers must not repeat across them."""
    out: list[SimTask] = []
    for path in paths:
        start = max((t.number for t in (*builtin, *out)), default=0) + 1
        out.extend(load_task_file(path, start))
    ids: dict[str, int] = {}
    numbers: dict[int, str] = {}
    for t in (*builtin, *out):
        if t.task_id in ids:
            raise ConfigError(f"task id {t.task_id!r} is given twice; give the task another id")
        if t.number in numbers:
            raise ConfigError(
                f"task number {t.number} is given twice ({numbers[t.number]!r} and "
                f"{t.task_id!r}); give one another number, or none (the next free one)"
            )
        ids[t.task_id], numbers[t.number] = t.number, t.task_id
    return tuple(out)


def _task(item: Any, where: _Where, number: int) -> SimTask:
    if not isinstance(item, dict):
        raise where.error("a task must be a mapping (name, description, app, validators, ...)")
    unknown = sorted(set(item) - _TASK_KEYS)
    if unknown:
        raise where.error(f"unknown keys {unknown}; a task has {sorted(_TASK_KEYS)}")
    for key in ("name", "description", "app"):
        if not isinstance(item.get(key), str) or not item[key].strip():
            raise where.error(f"'{key}' is required (a non-empty string)")
    if item["app"] not in APPS:
        raise where.error(f"app {item['app']!r} is not one of {', '.join(APPS)}")
    given = item.get("number", number)
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise where.error(f"number {given!r} must be a positive integer")
    task_id = item.get("id", f"user-{item['name'].strip().replace('_', '-').replace(' ', '-')}")
    if not isinstance(task_id, str) or not task_id or "/" in task_id:
        raise where.error(f"id {task_id!r} must be a non-empty string without '/'")
    validators = item.get("validators")
    if not isinstance(validators, list) or not validators:
        raise where.error("'validators' must be a non-empty list")
    checks = tuple(_validator(v, where, i) for i, v in enumerate(validators))
    if len({v.id for v in checks}) != len(checks):
        raise where.error("validator ids repeat; give each its own id")
    level = item.get("level", "user")
    if not isinstance(level, str) or not level:
        raise where.error(f"level {level!r} must be a non-empty string (a tag)")
    return SimTask(
        number=given,
        name=item["name"].strip(),
        difficulty=level,
        app=item["app"],
        description=item["description"].strip(),
        setup=_setup(item.get("start") or {}, where),
        validators=checks,
        solution=_solution(item.get("solution") or [], where),
        given_id=task_id,
    )


def _setup(start: Any, where: _Where) -> Callable[[PhoneState], None]:
    if not isinstance(start, dict):
        raise where.error("'start' must be a mapping of phone state fields")
    values: dict[str, Any] = {}
    for key, value in start.items():
        if key not in STATE_FIELDS:
            raise where.error(f"start.{key} is not a phone state field; use {sorted(STATE_FIELDS)}")
        values[key] = _state_value(f"start.{key}", key, value, where)
    if "screen" in values and values["screen"] not in SCREENS:
        raise where.error(f"start.screen {values['screen']!r} is not one of {', '.join(SCREENS)}")
    if not 0 <= values.get("brightness", 50) <= 100:
        raise where.error("start.brightness must be within 0..100")

    def setup(state: PhoneState) -> None:
        for key, value in values.items():
            setattr(state, key, list(value) if isinstance(value, list) else value)

    return setup


def _state_value(label: str, key: str, value: Any, where: _Where) -> Any:
    """``value`` checked against the type of the phone's field ``key``."""
    default = STATE_FIELDS[key].default
    if key == "notes":
        if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
            raise where.error(f"{label} must be a list of strings")
        return list(value)
    if key == "calc_result":
        if value is not None and not isinstance(value, str):
            raise where.error(f"{label} must be a string (quote numbers: '19') or null")
        return value
    kind = type(default)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise where.error(f"{label} must be an integer")
    if kind is not int and not isinstance(value, kind):
        raise where.error(f"{label} must be a {kind.__name__}")
    return value


def _validator(spec: Any, where: _Where, index: int) -> Validator:
    label = f"validators[{index}]"
    if not isinstance(spec, dict):
        raise where.error(f"{label} must be a mapping")
    unknown = sorted(set(spec) - _VALIDATOR_KEYS)
    if unknown:
        raise where.error(f"{label}: unknown keys {unknown}; use {sorted(_VALIDATOR_KEYS)}")
    kinds = [k for k in _KINDS if k in spec]
    if len(kinds) != 1:
        raise where.error(f"{label} needs exactly one of {', '.join(_KINDS)}")
    kind = kinds[0]
    vid = spec.get("id", f"{kind}_{index}")
    weight = spec.get("weight", 1)
    if not isinstance(vid, str) or not vid:
        raise where.error(f"{label}.id must be a non-empty string")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
        raise where.error(f"{label}.weight must be a positive number")
    comparisons = [c for c in _COMPARISONS if c in spec]
    if kind != "field" and comparisons:
        raise where.error(f"{label}: {comparisons[0]} goes with 'field', not '{kind}'")
    if kind != "note" and "present" in spec:
        raise where.error(f"{label}: 'present' goes with 'note'")
    if kind == "field":
        check = _field_check(spec, comparisons, where, label)
    elif kind == "note":
        present = spec.get("present", True)
        if not isinstance(spec["note"], str) or not isinstance(present, bool):
            raise where.error(f"{label}: note is a string and present true or false")
        check = _has_note(spec["note"].strip().lower(), present)
    elif kind == "answer":
        if not isinstance(spec["answer"], str | int | float) or isinstance(spec["answer"], bool):
            raise where.error(f"{label}.answer must be the text the answer has to contain")
        check = _answer(str(spec["answer"]))
    else:
        check = _python(spec["python"], where, label)
    # A Python check may read the answer: it gets it, so the audit assumes it does.
    return Validator(vid, float(weight), check, reads_answer=kind in ("answer", "python"))


def _field_check(spec: dict, comparisons: list[str], where: _Where, label: str) -> Check:
    key = spec["field"]
    if key not in STATE_FIELDS:
        raise where.error(
            f"{label}.field {key!r} is not a phone state field: {sorted(STATE_FIELDS)}"
        )
    if len(comparisons) != 1:
        raise where.error(f"{label}: 'field' needs exactly one of {', '.join(_COMPARISONS)}")
    op, value = comparisons[0], spec[comparisons[0]]
    if op == "equals":
        return _is(key, _state_value(f"{label}.equals", key, value, where))
    if op == "count":
        if key != "notes" or isinstance(value, bool) or not isinstance(value, int):
            raise where.error(f"{label}: count takes field notes and an integer")
        return _note_count(value)
    if op == "contains":
        if not isinstance(value, str):
            raise where.error(f"{label}.contains must be a string")
        return _contains(key, value)
    bounds = value if op == "between" else [value, value]
    if (
        not isinstance(bounds, list)
        or len(bounds) != 2
        or any(isinstance(b, bool) or not isinstance(b, int | float) for b in bounds)
    ):
        raise where.error(f"{label}.{op} must be a number (between: [low, high])")
    if op == "at_least":
        return _at_least(key, value)
    if op == "at_most":
        return _between(key, None, value)
    return _between(key, bounds[0], bounds[1])


def _between(attr: str, lo: float | None, hi: float) -> Check:
    def check(s: PhoneState, _a: str | None) -> tuple[bool, str]:
        got = getattr(s, attr)
        ok = isinstance(got, int | float) and (lo is None or lo <= got) and got <= hi
        want = f"at most {hi}" if lo is None else f"{lo}..{hi}"
        return ok, f"{attr} is {got!r}, want {want}"

    return check


def _contains(attr: str, text: str) -> Check:
    def check(s: PhoneState, _a: str | None) -> tuple[bool, str]:
        got = getattr(s, attr)
        items = got if isinstance(got, list) else [got]
        ok = any(isinstance(g, str) and text.lower() in g.lower() for g in items)
        return ok, f"{attr} is {got!r}, want it to contain {text!r}"

    return check


def _python(target: Any, where: _Where, label: str) -> Check:
    if not isinstance(target, str) or target.count(":") != 1:
        raise where.error(f"{label}.python must be 'module:function'")
    module, name = target.split(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise where.error(f"{label}.python {target!r} cannot be imported: {exc}") from None
    if not callable(fn):
        raise where.error(f"{label}.python {target!r} is not callable")

    def check(s: PhoneState, a: str | None) -> tuple[bool, str]:
        result = fn(s, a)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool)):
            return False, f"{target} answered {result!r}, not (passed, message)"
        return result[0], str(result[1])

    return check


def _solution(steps: Any, where: _Where) -> tuple[str, ...]:
    if not isinstance(steps, list) or not all(isinstance(s, str) for s in steps):
        raise where.error("'solution' must be a list of actions such as 'tap(300, 116)'")
    for i, step in enumerate(steps):
        try:
            parse_action(step)
        except ActionParseError as exc:
            raise where.error(f"solution[{i}] {step!r}: {exc}") from None
    return tuple(steps)
