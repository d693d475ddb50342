"""Evaluation answer -> reward, with explicit semantics, and composable shaping transforms.

Semantics (docs/design.md, decision 5): the verdict lives in ``result`` (``score``, ``success``,
``validators``), or, from older gym servers, in ``final_result`` (with ``checks``) or
``evaluation_result.final_result``. A numeric ``score`` wins and a real 0 stays 0; without one,
``success`` gives 1/0; without either, the weighted validator/check scores decide. The top-level
``success`` only says the evaluate call worked: it never makes a task a success, and ``false``
there means the evaluation itself failed. No verdict at all is an infrastructure failure and
raises :class:`~cua_rl.errors.RejectedEpisode` ("no_verdict"), never a silent 0.

Shaping follows the step/final reward transformations of game-RL libraries: small callables
``(reward, facts) -> reward`` composed in order, built from YAML/dicts by name, e.g.::

    shaping:
      - {name: parse_error_penalty, penalty: 0.05}
      - {name: step_cost, cost: 0.01}
      - {name: format_bonus, bonus: 0.1}
      - {name: clip, low: -1.0, high: 1.0}

An unknown name or parameter is a :class:`~cua_rl.errors.ConfigError`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cua_rl.core.fields import doc
from cua_rl.core.reasons import Reason
from cua_rl.errors import ConfigError, RejectedEpisode

# ---- verdict --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """The task outcome read from an evaluation answer."""

    score: float  # in the gym's units (usually 0..1); the base reward
    success: bool | None  # the gym's own success flag for the task, when it gave one
    source: str  # which field decided: "score", "success" or "validators"


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _verdict_object(answer: Mapping) -> tuple[Mapping | None, str]:
    for key in ("result", "final_result"):
        obj = answer.get(key)
        if isinstance(obj, Mapping):
            return obj, key
    ev = answer.get("evaluation_result")
    if isinstance(ev, Mapping):
        inner = ev.get("final_result")
        if isinstance(inner, Mapping):
            return inner, "evaluation_result.final_result"
        return ev, "evaluation_result"
    return None, ""


def _checks_score(checks: Any) -> float | None:
    if not isinstance(checks, list) or not checks:
        return None
    total = got = 0.0
    for c in checks:
        if not isinstance(c, Mapping):
            return None
        weight = _number(c.get("weight"))
        weight = 1.0 if weight is None else weight
        score = _number(c.get("score"))
        if score is None:
            passed = c.get("pass", c.get("passed", c.get("success")))
            if not isinstance(passed, bool):
                return None
            score = 1.0 if passed else 0.0
        total += weight
        got += weight * score
    return got / total if total > 0 else None


def verdict_from_evaluation(answer: Any) -> Verdict:
    """Read the task verdict; raises RejectedEpisode when the answer holds none.

    ``answer`` is the evaluate call's JSON, or an object carrying it as ``.raw`` (such as
    :class:`cua_rl.clients.genv.EvaluationResult`).
    """
    raw = getattr(answer, "raw", None)
    if not isinstance(answer, Mapping) and isinstance(raw, Mapping):
        answer = raw
    if not isinstance(answer, Mapping):
        raise RejectedEpisode(Reason.NO_VERDICT, f"evaluation answer is {type(answer).__name__}")
    obj, where = _verdict_object(answer)
    if obj is None:
        if answer.get("success") is False:
            detail = answer.get("detail") or answer.get("error") or "evaluate reported failure"
            raise RejectedEpisode(Reason.EVALUATION_FAILED, str(detail)[:300])
        raise RejectedEpisode(
            Reason.NO_VERDICT, "answer has no result / final_result / evaluation_result object"
        )
    success = obj.get("success") if isinstance(obj.get("success"), bool) else None
    score = _number(obj.get("score"))
    if score is not None:
        return Verdict(score, success, "score")
    if success is not None:
        return Verdict(1.0 if success else 0.0, success, "success")
    checks = obj.get("validators", obj.get("checks"))
    cs = _checks_score(checks)
    if cs is not None:
        return Verdict(cs, None, "validators")
    raise RejectedEpisode(Reason.NO_VERDICT, f"{where} has no score, success or validators")


# ---- episode facts for shaping -------------------------------------------------------------


@dataclass(frozen=True)
class EpisodeFacts:
    """What shaping may look at, independent of how the episode was recorded."""

    steps: int = 0
    parse_errors: int = 0  # model replies that held no action
    invalid_actions: int = 0  # parsed actions the environment refused
    finished: bool = False  # the agent called `finished`

    @classmethod
    def from_turns(cls, turns: Iterable[Any]) -> EpisodeFacts:
        """From :class:`cua_rl.trajectory.Turn`-like objects (``action_parsed``, ``action_ok``)."""
        turns = list(turns)
        parse_errors = sum(1 for t in turns if not t.action_parsed)
        invalid = sum(1 for t in turns if t.action_parsed and not t.action_ok)
        finished = any(a.get("name") == "finished" for t in turns for a in t.actions)
        return cls(len(turns), parse_errors, invalid, finished)


# ---- shaping transforms ----------------------------------------------------------------------


class RewardTransform:
    """``(reward, facts) -> reward``; subclasses hold their parameters as attributes."""

    name = ""

    def __call__(self, reward: float, facts: EpisodeFacts) -> float:
        raise NotImplementedError

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({params})"


class _CountPenalty(RewardTransform):
    """Subtract ``penalty`` per occurrence of one of the episode's counts (``fact``), capped at
    ``max_total``."""

    fact = ""

    def __init__(self, penalty: float = 0.1, max_total: float | None = None):
        self.penalty = _nonneg(f"{self.name}.penalty", penalty)
        self.max_total = None if max_total is None else _nonneg("max_total", max_total)

    def __call__(self, reward, facts):
        cut = self.penalty * getattr(facts, self.fact)
        return reward - (cut if self.max_total is None else min(cut, self.max_total))


class ParseErrorPenalty(_CountPenalty):
    """Subtract ``penalty`` per reply without a parsable action (capped at ``max_total``)."""

    name = "parse_error_penalty"
    fact = "parse_errors"


class InvalidActionPenalty(_CountPenalty):
    """Subtract ``penalty`` per action the environment refused (capped at ``max_total``)."""

    name = "invalid_action_penalty"
    fact = "invalid_actions"


class StepCost(RewardTransform):
    """Subtract ``cost`` per step beyond ``free_steps`` (favours shorter solutions)."""

    name = "step_cost"

    def __init__(self, cost: float = 0.01, free_steps: int = 0):
        self.cost = _nonneg("step_cost.cost", cost)
        if isinstance(free_steps, bool) or not isinstance(free_steps, int) or free_steps < 0:
            raise ConfigError("step_cost.free_steps must be an integer >= 0")
        self.free_steps = free_steps

    def __call__(self, reward, facts):
        return reward - self.cost * max(0, facts.steps - self.free_steps)


class FormatBonus(RewardTransform):
    """Add ``bonus`` when every reply parsed as an action, else add ``-penalty``."""

    name = "format_bonus"

    def __init__(self, bonus: float = 0.1, penalty: float = 0.0):
        self.bonus = _nonneg("format_bonus.bonus", bonus)
        self.penalty = _nonneg("format_bonus.penalty", penalty)

    def __call__(self, reward, facts):
        ok = facts.steps > 0 and facts.parse_errors == 0
        return reward + (self.bonus if ok else -self.penalty)


class Scale(RewardTransform):
    """Multiply by ``factor``."""

    name = "scale"

    def __init__(self, factor: float = 1.0):
        self.factor = _finite("scale.factor", factor)

    def __call__(self, reward, facts):
        return reward * self.factor


class Clip(RewardTransform):
    """Clamp into ``[low, high]`` (usually last, to bound shaped rewards)."""

    name = "clip"

    def __init__(self, low: float = -1.0, high: float = 1.0):
        self.low, self.high = _finite("clip.low", low), _finite("clip.high", high)
        if self.low > self.high:
            raise ConfigError(f"clip.low ({low}) must be <= clip.high ({high})")

    def __call__(self, reward, facts):
        return min(self.high, max(self.low, reward))


def _finite(what: str, v: Any) -> float:
    x = _number(v)
    if x is None:
        raise ConfigError(f"{what} must be a finite number, got {v!r}")
    return x


def _nonneg(what: str, v: Any) -> float:
    x = _finite(what, v)
    if x < 0:
        raise ConfigError(f"{what} must be >= 0 (it is subtracted/added as given), got {v!r}")
    return x


TRANSFORMS: dict[str, type[RewardTransform]] = {
    cls.name: cls
    for cls in (ParseErrorPenalty, InvalidActionPenalty, StepCost, FormatBonus, Scale, Clip)
}


class ComposeRewardTransforms:
    """Apply transforms in order; each sees the previous one's output."""

    def __init__(self, transforms: Sequence[Callable[[float, EpisodeFacts], float]] = ()):
        self.transforms = list(transforms)

    def __call__(self, reward: float, facts: EpisodeFacts) -> float:
        for t in self.transforms:
            reward = float(t(reward, facts))
        return reward

    def __repr__(self) -> str:
        return f"ComposeRewardTransforms({self.transforms!r})"


def build_transform(spec: Mapping[str, Any] | str) -> RewardTransform:
    """One transform from ``{"name": ..., **params}``, ``{name: {params}}`` or a bare name."""
    if isinstance(spec, str):
        name, params = spec, {}
    elif isinstance(spec, Mapping) and "name" in spec:
        params = {k: v for k, v in spec.items() if k != "name"}
        name = spec["name"]
    elif isinstance(spec, Mapping) and len(spec) == 1:
        ((name, params),) = spec.items()
        if name in TRANSFORMS and not isinstance(params, Mapping | None):
            raise ConfigError(f"parameters of shaping term {name!r} must be a mapping")
        params = dict(params or {}) if isinstance(params, Mapping | None) else {}
    else:
        raise ConfigError(
            f"shaping term {spec!r}: write {{name: step_cost, cost: 0.01}} or {{step_cost: {{cost: 0.01}}}}"
        )
    cls = TRANSFORMS.get(name)
    if cls is None:
        raise ConfigError(
            f"unknown shaping term {name!r}; known terms: {', '.join(sorted(TRANSFORMS))}"
        )
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = set(params) - accepted
    if unknown:
        raise ConfigError(
            f"shaping term {name!r} has no parameter(s) {sorted(unknown)}; it accepts {sorted(accepted)}"
        )
    return cls(**params)


def build_shaping(specs: Iterable[Mapping[str, Any] | str] | None) -> ComposeRewardTransforms:
    if specs is None:
        return ComposeRewardTransforms()
    if isinstance(specs, Mapping | str):
        raise ConfigError("shaping must be a list of terms, e.g. [{name: step_cost, cost: 0.01}]")
    return ComposeRewardTransforms([build_transform(s) for s in specs])


# ---- the whole computation -------------------------------------------------------------------


@dataclass
class RewardConfig:
    shaping: list = doc(
        factory=list,
        help=(
            "Shaping terms applied in order after the verdict, e.g. "
            "[{name: parse_error_penalty, penalty: 0.05}, {name: step_cost, cost: 0.01}]; "
            f"terms: {', '.join(sorted(TRANSFORMS))}."
        ),
    )
    success_threshold: float = doc(
        1.0,
        (
            "Score at or above which an episode counts as a success when the gym "
            "gives no success flag (used for the success statistic only, not the reward)."
        ),
    )

    def __post_init__(self) -> None:
        self._compiled = build_shaping(self.shaping)
        _finite("success_threshold", self.success_threshold)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RewardConfig:
        data = dict(data or {})
        known = {"shaping", "success_threshold"}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(
                f"unknown reward config key(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        return cls(**data)

    @classmethod
    def from_yaml(cls, text: str) -> RewardConfig:
        import yaml

        return cls.from_dict(yaml.safe_load(text) or {})

    @property
    def transform(self) -> ComposeRewardTransforms:
        return self._compiled


@dataclass(frozen=True)
class RewardOutcome:
    reward: float  # what goes into the row
    base: float  # the verdict's score before shaping
    success: bool  # task solved (gym flag, else score >= success_threshold)
    verdict: Verdict


def compute_reward(
    answer: Any, facts: EpisodeFacts | None = None, config: RewardConfig | None = None
) -> RewardOutcome:
    """Evaluation answer (+ episode facts) -> reward; raises RejectedEpisode without a verdict."""
    config = config or RewardConfig()
    verdict = verdict_from_evaluation(answer)
    reward = config.transform(verdict.score, facts or EpisodeFacts())
    success = (
        verdict.success
        if verdict.success is not None
        else verdict.score >= config.success_threshold
    )
    return RewardOutcome(float(reward), verdict.score, bool(success), verdict)
