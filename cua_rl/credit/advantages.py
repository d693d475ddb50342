"""Step advantages of one task's group, and the per-token tensor that carries them to the actor.

GiGPO's step credit without a critic (docs/credit.md): the steps of a group's episodes that start
from one state (``keys.Clusters``) form a step group; a step's return is its episode's reward
discounted by the steps after it (``gamma``); its step advantage is that return minus its step
group's mean (divided by the group's std with ``std_scale``). A step alone in its step group
gets 0: with no other step from its state there is nothing to compare it with, and it keeps only
its episode's advantage. A step visited twice by one episode (a revisited screen) counts twice.

``token_advantages`` lays ``weight`` times each step's advantage on the tokens its turns sampled,
row by row (one row per call or one row spanning every step alike); the group filter writes the
result into the group's rows under ``STEP_ADVANTAGES``, and the actor adds it to the advantage
AReaL's GAE gives each token (the episode's) before AReaL's batch normalisation
(``cua_rl.credit.trainer``).

A false merge: two steps of one step group that did the same thing and reached states that are
not the same (their next keys differ). In a deterministic environment the same action on the
same state leads to the same state, so the key merged two states; each (step group, action) pair
with more than one outcome is counted once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cua_rl.credit.config import StepCreditConfig
from cua_rl.credit.keys import Clusters, same_state
from cua_rl.credit.steps import EpisodeSteps

# The per-token row key the group filter adds and the actor consumes (float32 [rows, n]).
STEP_ADVANTAGES = "step_advantages"


@dataclass(frozen=True)
class StepValue:
    """One step's credit: its return, advantage, step group (index and size) and whether that
    group holds a false merge of this step's action."""

    ret: float
    advantage: float
    group: int | None
    size: int
    false_merge: bool = False


@dataclass
class GroupCredit:
    """A group's step credit: per episode (position in the group) per agent step its value,
    and the group's statistics (``cua/credit/...``)."""

    values: list[dict[int, StepValue]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)


def step_credit(
    episodes: Sequence[EpisodeSteps | None], rewards: Sequence[float], config: StepCreditConfig
) -> GroupCredit:
    """Step advantages of a group: ``episodes`` (None where an episode's steps are unknown: its
    steps get nothing) with their ``rewards`` (the raw episode rewards, as normalised into the
    episode advantages)."""
    clusters = Clusters(config.key)
    members: dict[int, list[tuple[int, int, float]]] = {}  # group -> (episode, step, return)
    placed: list[list[tuple[int, int | None, float]]] = []
    unkeyed = 0
    for e, (ep, reward) in enumerate(zip(episodes, rewards, strict=True)):
        rows: list[tuple[int, int | None, float]] = []
        if ep is not None and ep.steps:
            last = ep.steps[-1].step
            for s in ep.steps:
                g = clusters.assign(s.key)
                ret = float(reward) * config.gamma ** (last - s.step)
                rows.append((s.step, g, ret))
                if g is None:
                    unkeyed += 1
                else:
                    members.setdefault(g, []).append((e, s.step, ret))
        placed.append(rows)
    advantage = _advantages(members, config)
    merged = _false_merges(episodes, clusters, members, config)
    out = GroupCredit()
    for e, rows in enumerate(placed):
        values = {}
        for step, g, ret in rows:
            size = len(members[g]) if g is not None else 1
            values[step] = StepValue(
                ret,
                advantage.get((e, step), 0.0),
                g,
                size,
                (g, _action(episodes[e], step)) in merged,
            )
        out.values.append(values)
    steps = sum(len(rows) for rows in placed)
    sizes = [len(m) for m in members.values()]
    grouped = sum(n for n in sizes if n >= 2)
    out.stats = {
        "cua/credit/steps": float(steps),
        "cua/credit/grouped_share": grouped / steps if steps else 0.0,
        "cua/credit/step_groups": float(len(sizes)),
        "cua/credit/step_group_size": sum(sizes) / len(sizes) if sizes else 0.0,
        "cua/credit/step_group_size_max": float(max(sizes, default=0)),
        "cua/credit/unkeyed_share": unkeyed / steps if steps else 0.0,
        "cua/credit/false_merges": float(len(merged)),
        "cua/credit/unknown_episodes": float(sum(ep is None for ep in episodes)),
    }
    moved = [abs(v.advantage) for values in out.values for v in values.values()]
    out.stats["cua/credit/step_advantage_abs"] = sum(moved) / len(moved) if moved else 0.0
    return out


def _advantages(members, config: StepCreditConfig) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = {}
    for items in members.values():
        if len(items) < 2:
            continue
        rets = [r for _, _, r in items]
        mean = sum(rets) / len(rets)
        scale = 1.0
        if config.std_scale:
            var = sum((r - mean) ** 2 for r in rets) / (len(rets) - 1)
            scale = math.sqrt(var) + config.eps
        for e, step, r in items:
            out[(e, step)] = (r - mean) / scale
    return out


def _action(ep: EpisodeSteps | None, step: int) -> str | None:
    if ep is None:
        return None
    return next((s.action for s in ep.steps if s.step == step), None)


def _false_merges(episodes, clusters: Clusters, members, config) -> set[tuple[int, str]]:
    """(step group, action) pairs whose steps reached states that are not the same."""
    outcomes: dict[tuple[int, str], list[Any]] = {}
    by_step = {(e, s.step): s for e, ep in enumerate(episodes) if ep is not None for s in ep.steps}
    for g, items in members.items():
        for e, step, _ in items:
            s = by_step[(e, step)]
            if s.next_key is not None and s.next_key.kind:
                outcomes.setdefault((g, s.action), []).append(s.next_key)
    merged = set()
    for pair, nexts in outcomes.items():
        first = nexts[0]
        if any(not same_state(first, other, clusters.config) for other in nexts[1:]):
            merged.add(pair)
    return merged


def token_advantages(
    shape: tuple[int, int],
    rows: Sequence[Sequence[int]],
    episodes: Sequence[EpisodeSteps | None],
    credit: GroupCredit,
    weight: float,
):
    """The group's ``STEP_ADVANTAGES`` tensor (float32 ``shape``, the group's padded rows):
    ``weight`` times each step's advantage on the tokens its turns sampled, 0 elsewhere.
    ``rows``: each episode's row indices in the group, in its order. An episode whose rows do
    not match its step spans in number or length gets nothing (``cua/credit/unknown_episodes``
    counts it with the caller)."""
    import torch

    out = torch.zeros(shape, dtype=torch.float32)
    mismatched = 0
    for e, (ep, idx) in enumerate(zip(episodes, rows, strict=True)):
        if ep is None:
            continue
        if len(ep.spans) != len(idx) or any(
            end > shape[1] for spans in ep.spans for _, end, _ in spans
        ):
            mismatched += 1
            continue
        values = credit.values[e]
        for r, spans in zip(idx, ep.spans, strict=True):
            for start, end, step in spans:
                value = values.get(step)
                if value is not None and value.advantage:
                    out[r, start:end] = weight * value.advantage
    credit.stats["cua/credit/mismatched_episodes"] = float(mismatched)
    return out


def turn_notes(
    episodes: Sequence[EpisodeSteps | None], credit: GroupCredit, weight: float
) -> list[dict[str, Any]]:
    """The monitor's turn updates of a group's fresh episodes (those with a rollout id): each
    step's advantage, return, state key and step group, under the turn's ``step_credit`` (an
    extra field the monitor keeps and the rollout page shows)."""
    from cua_rl.monitor.protocol import turn_client_id

    out = []
    for ep, values in zip(episodes, credit.values, strict=True):
        if ep is None or not ep.rollout_uuid:
            continue
        for s in ep.steps:
            v = values.get(s.step)
            if v is None:
                continue
            out.append(
                {
                    "client_id": turn_client_id(ep.rollout_uuid, s.step),
                    "rollout_client_id": ep.rollout_uuid,
                    "turn": s.step,
                    "step_credit": {
                        "advantage": round(weight * v.advantage, 6),
                        "return": round(v.ret, 6),
                        "state_key": str(s.key) if s.key.kind else None,
                        "step_group": v.group,
                        "step_group_size": v.size,
                        "false_merge": v.false_merge,
                    },
                }
            )
    return out
