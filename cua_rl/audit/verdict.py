"""A task's verdict from its runs, with the evidence: pure functions over ``Run`` records.

Flags, in the order the verdict names the first:

- ``free_reward``: a run that does nothing is rewarded (``stop``, ``wait``, ``infeasible``, or
  ``answer``: the final answer of a success that changed the state, without its actions), a
  random run is rewarded though none of its actions changed the state, or a replayed success
  stays rewarded, as much as before, with any one of its state-changing actions removed (no
  single one of them is needed: the reward does not follow from what the agent did). One
  ablation still rewarded proves nothing alone: a recorded success may hold actions that do
  not matter.
- ``rejects_success``: a replayed success (a recorded one, or the task's solution) is not
  rewarded in any of its runs (rewarded in some and not others: flaky).
- ``flaky``: one plan's runs (the same action sequence on fresh boxes) got different rewards.

A task with none is ``clean``; one whose every run failed in the gym is ``unchecked`` (a gym
failure never passes for a verdict), as are runs of an agent the gym cannot serve (no box
routes), which are named in ``skipped``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cua_rl.audit.runner import Run
from cua_rl.audit.state import UNCHANGED
from cua_rl.monitor.protocol import AUDIT_FLAGS, AUDIT_LABELS, AUDIT_VERDICTS

FLAGS, VERDICTS = AUDIT_FLAGS, AUDIT_VERDICTS
FREE_REWARD, REJECTS_SUCCESS, FLAKY = FLAGS
CLEAN, UNCHECKED = VERDICTS[len(FLAGS) :]
LABELS = AUDIT_LABELS  # how the table and the dashboard name them
DO_NOTHING = {
    "stop": "stopping at once",
    "wait": "looking at the screen, then stopping",
    "infeasible": "answering at once that the task cannot be done",
    "answer": "giving a known success's final answer at once, with none of its actions,",
}


@dataclass
class Flag:
    kind: str
    agent: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kind": self.kind, "agent": self.agent, "message": self.message, **self.evidence}


def _evidence(run: Run) -> dict[str, Any]:
    return {
        "plan": run.plan,
        "repeat": run.repeat,
        "score": run.score,
        "success": run.success,
        "effect": run.effect,
        "validators": run.validators,
        "execution_id": run.execution_id,
    }


def _messages(run: Run) -> str:
    parts = [f"{v['id']}: {v['message']}" for v in run.validators if v.get("message")]
    return "; ".join(parts)[:300]


def _score(run: Run) -> str:
    return "no score" if run.score is None else f"score {run.score:g}"


def free_rewards(runs: Iterable[Run]) -> list[Flag]:
    """One flag per plan whose runs are rewarded for doing nothing (in how many runs)."""
    paid: dict[str, list[Run]] = {}
    tried: dict[str, int] = {}
    for run in runs:
        if not run.ok:
            continue
        tried[run.plan] = tried.get(run.plan, 0) + 1
        nothing = run.agent in DO_NOTHING or (run.agent == "random" and run.effect == UNCHANGED)
        if run.rewarded and nothing:
            paid.setdefault(run.plan, []).append(run)
    flags = []
    for plan, group in paid.items():
        run = group[0]
        if run.agent in DO_NOTHING:
            what = DO_NOTHING[run.agent]
        else:
            what = f"a run of {len(run.effects)} random actions, none of which changed the state,"
        flags.append(
            Flag(
                FREE_REWARD,
                run.agent,
                f"{what} is rewarded in {len(group)} of {tried[plan]} runs ({_score(run)}; "
                f"{_messages(run)})",
                _evidence(run),
            )
        )
    return flags


def ablation_flags(replays: list[Run], ablations: list[Run]) -> list[Flag]:
    """Free reward from replays: a rewarded replay that changed nothing, or whose every
    single-removal ablation is still rewarded."""
    flags = []
    for replay in replays:
        if not replay.ok or not replay.rewarded or replay.repeat != 0:
            continue
        if replay.effect == UNCHANGED:
            flags.append(
                Flag(
                    FREE_REWARD,
                    "replay",
                    f"the replayed success changed nothing and is rewarded ({_score(replay)})",
                    _evidence(replay),
                )
            )
            continue
        mine = [a for a in ablations if a.ok and a.plan.startswith(f"ablation:{_key(replay)}-")]
        if mine and all(_as_good(a, replay) for a in mine):
            removed = sorted({a.plan.rsplit("-", 1)[1] for a in mine}, key=int)
            flags.append(
                Flag(
                    FREE_REWARD,
                    "ablation",
                    f"the replayed success stays rewarded with any one of its state-changing "
                    f"actions removed (steps {', '.join(removed)}; {_score(mine[0])})",
                    {**_evidence(mine[0]), "removed_steps": [int(r) for r in removed]},
                )
            )
    return flags


def _as_good(ablation: Run, replay: Run) -> bool:
    """The removal cost nothing: still rewarded, as much as the replay (partial credit that
    drops says the action mattered)."""
    if not ablation.rewarded or (replay.success is True and ablation.success is not True):
        return False
    return ablation.score is None or replay.score is None or ablation.score >= replay.score


def _key(run: Run) -> str:
    return run.plan.split(":", 1)[1] if ":" in run.plan else ""


def rejected_successes(replays: Iterable[Run]) -> list[Flag]:
    """A replay none of whose runs is rewarded (some rewarded, some not: flaky)."""
    by_plan: dict[str, list[Run]] = {}
    for run in replays:
        if run.ok:
            by_plan.setdefault(run.plan, []).append(run)
    flags = []
    for group in by_plan.values():
        if any(r.rewarded and r.success is not False for r in group):
            continue
        run = group[0]
        flags.append(
            Flag(
                REJECTS_SUCCESS,
                "replay",
                f"the replayed success ({run.plan}) is not rewarded in any of its {len(group)} "
                f"runs ({_score(run)}; {_messages(run)})",
                _evidence(run),
            )
        )
    return flags


def flaky_plans(runs: Iterable[Run]) -> list[Flag]:
    by_plan: dict[str, list[Run]] = {}
    for run in runs:
        if run.ok:
            by_plan.setdefault(run.plan, []).append(run)
    flags = []
    for plan, group in by_plan.items():
        outcomes = {r.outcome for r in group}
        if len(outcomes) < 2:
            continue
        scores = [r.score for r in sorted(group, key=lambda r: r.repeat)]
        first, other = group[0], next(r for r in group if r.outcome != group[0].outcome)
        flags.append(
            Flag(
                FLAKY,
                group[0].agent,
                f"one action sequence ({plan}) got different rewards: {scores} "
                f"({_messages(first)} | {_messages(other)})",
                {"plan": plan, "scores": scores, "runs": [_evidence(first), _evidence(other)]},
            )
        )
    return flags


@dataclass
class TaskVerdict:
    verdict: str
    flags: list[Flag]
    summary: dict[str, dict[str, int]]  # per agent: runs, rewarded, errors

    @property
    def flagged(self) -> bool:
        return self.verdict in FLAGS


def judge(runs: list[Run]) -> TaskVerdict:
    replays = [r for r in runs if r.agent == "replay"]
    ablations = [r for r in runs if r.agent == "ablation"]
    flags = [
        *free_rewards(runs),
        *ablation_flags(replays, ablations),
        *rejected_successes(replays),
        *flaky_plans(runs),
    ]
    summary: dict[str, dict[str, int]] = {}
    for r in runs:
        s = summary.setdefault(r.agent, {"runs": 0, "rewarded": 0, "errors": 0})
        s["runs"] += 1
        s["rewarded"] += int(r.ok and r.rewarded)
        s["errors"] += int(not r.ok)
    kinds = {f.kind for f in flags}
    verdict = next((k for k in FLAGS if k in kinds), None)
    if verdict is None:
        verdict = CLEAN if any(r.ok for r in runs) else UNCHECKED
    return TaskVerdict(verdict, flags, summary)
