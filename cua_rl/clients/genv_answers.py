"""The gym server's answers, parsed: a created execution and an evaluation, in every shape.

Servers of different ages answer in different shapes (docs/design.md, the gym server): the box
id of a created execution sits under one of several keys, and an evaluation's verdict under
``result``, ``final_result.checks`` or ``evaluation_result.final_result``. These functions fold
them into one dataclass each; an answer with no verdict at all is a ``GymError``. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cua_rl.errors import GymError

BOX_ID_KEYS = ("box_id", "gbox_id", "boxId", "container_id", "env_id", "environment_id")
BOX_ID_PATHS = (("device", "device_serial"), ("environment", "id"), ("box", "id"))


@dataclass(frozen=True)
class CreatedExecution:
    execution_id: str
    task_id: str
    box_id: str | None
    raw: dict


@dataclass(frozen=True)
class ValidatorResult:
    id: str
    passed: bool
    score: float | None
    weight: float | None
    message: str | None
    raw: dict


@dataclass(frozen=True)
class EvaluationResult:
    """The verdict of one evaluate call. ``call_ok`` is the top-level ``success``: the call worked."""

    call_ok: bool | None
    score: float | None
    success: bool | None
    validators: tuple[ValidatorResult, ...]
    raw: dict


def parse_created(data: Any, task_id: str) -> CreatedExecution:
    """Pull the execution id (required) and a box id (optional, many spellings) from a create answer."""
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("execution_id"), str | int)
        or data["execution_id"] == ""
    ):
        raise GymError(f"create for task {task_id!r} answered without an execution_id", body=data)
    box = next((data[k] for k in BOX_ID_KEYS if data.get(k)), None)
    if box is None:
        for outer, inner in BOX_ID_PATHS:
            o = data.get(outer)
            if isinstance(o, dict) and o.get(inner):
                box = o[inner]
                break
    return CreatedExecution(
        str(data["execution_id"]), task_id, None if box is None else str(box), data
    )


def _num(v: Any, what: str, raw: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise GymError(f"evaluate answer has a non-numeric {what}: {v!r}", body=raw)
    return float(v)


def _flag(v: Any, what: str, raw: Any) -> bool | None:
    if v is None or isinstance(v, bool):
        return v
    raise GymError(f"evaluate answer has a non-boolean {what}: {v!r}", body=raw)


def parse_evaluation(data: Any) -> EvaluationResult:
    """Parse every evaluate shape (docs/design.md, the gym server); an answer with no verdict
    at all is a ``GymError``.

    Shapes: ``{"success", "result": {...}}``, older ``{"final_result": {"checks": [...]}}`` and
    ``{"evaluation_result": {"final_result": {...}}}``. Nothing is defaulted: a missing score
    stays ``None`` rather than becoming a silent zero.
    """
    if not isinstance(data, dict):
        raise GymError("evaluate answered something other than a JSON object", body=data)
    final = data.get("result")
    if not isinstance(final, dict):
        final = data.get("final_result")
    if not isinstance(final, dict):
        er = data.get("evaluation_result")
        final = er.get("final_result") if isinstance(er, dict) else None
    call_ok = _flag(data.get("success"), "top-level success", data)
    if not isinstance(final, dict):
        why = data.get("detail") or data.get("error") or data.get("message") or "no result object"
        raise GymError(f"evaluate answer carries no verdict ({str(why)[:200]})", body=data)
    entries = final.get("validators", final.get("checks", []))
    if not isinstance(entries, list):
        raise GymError("evaluate answer's validators are not a list", body=data)
    validators = []
    for i, v in enumerate(entries):
        if not isinstance(v, dict):
            raise GymError(f"evaluate validator #{i} is not an object: {v!r}", body=data)
        passed = next((v[k] for k in ("pass", "passed", "success") if k in v), None)
        passed = _flag(passed, f"validator #{i} pass", data)
        if passed is None:
            raise GymError(f"evaluate validator #{i} has no pass/passed flag", body=data)
        vid = v.get("id", v.get("name", v.get("validator_id", f"#{i}")))
        msg = v.get("message", v.get("reason"))
        validators.append(
            ValidatorResult(
                str(vid),
                passed,
                _num(v.get("score"), f"validator #{i} score", data),
                _num(v.get("weight"), f"validator #{i} weight", data),
                None if msg is None else str(msg),
                v,
            )
        )
    score = _num(final.get("score"), "score", data)
    success = _flag(final.get("success", final.get("passed")), "result success", data)
    if score is None and success is None and not validators:
        raise GymError("evaluate answer carries no score, success or validators", body=data)
    return EvaluationResult(call_ok, score, success, tuple(validators), data)
