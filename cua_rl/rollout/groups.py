"""Group filters for ``PPOTrainer.train(dynamic_filter_fn=...)``, passed by dotted path.

AReaL runs the filter in the rollout worker on each finished group (the rows of the
``gconfig.n_samples`` episodes of one task, concatenated) and trains only accepted groups; for a
rejected one it draws another task. Its group normalisation slices fixed-size chunks of rows
with no check, so a group that lost a member would mix groups: both filters drop those. A group
whose rewards are all equal has zero advantage everywhere and teaches nothing;
``complete_groups`` only counts it, ``complete_varied_groups`` also drops it.

Each group records 0/1 stats under the rollout scope, so the step's stats (means over the
step's groups) are shares: ``cua/group/accepted``, ``cua/group/rejected/incomplete``,
``cua/group/zero_variance`` (of complete groups) and, from ``complete_varied_groups`` only,
``cua/group/rejected/zero_variance``.
"""

from __future__ import annotations

import os
from typing import Any

from cua_rl.errors import ConfigError
from cua_rl.logs import get_logger

log = get_logger("cua_rl.rollout.groups")

GROUP_SIZE_ENV = "CUA_RL_GROUP_SIZE"
# Rewards within this spread count as equal; train.py sets it from curriculum.zero_variance_tol.
ZERO_VARIANCE_TOL_ENV = "CUA_RL_ZERO_VARIANCE_TOL"
DEFAULT_ZERO_VARIANCE_TOL = 1e-6

COMPLETE_GROUPS = "cua_rl.rollout.groups.complete_groups"
COMPLETE_VARIED_GROUPS = "cua_rl.rollout.groups.complete_varied_groups"


def expected_group_size() -> int:
    expected = os.environ.get(GROUP_SIZE_ENV)
    if not expected:
        raise ConfigError(
            f"the group filter needs ${GROUP_SIZE_ENV} (the group size, gconfig.n_samples); "
            "train.py sets it: set it yourself when you use the filter elsewhere"
        )
    try:
        return int(expected)
    except ValueError:
        raise ConfigError(f"${GROUP_SIZE_ENV}={expected!r} is not an integer") from None


def zero_variance_tol() -> float:
    raw = os.environ.get(ZERO_VARIANCE_TOL_ENV)
    if not raw:
        return DEFAULT_ZERO_VARIANCE_TOL
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"${ZERO_VARIANCE_TOL_ENV}={raw!r} is not a number") from None


def reward_spread(traj: dict[str, Any]) -> float:
    rewards = traj["rewards"].detach().float().reshape(-1)
    return float(rewards.max() - rewards.min())


def _record(**stats: float) -> None:
    from areal import workflow_context
    from areal.utils import stats_tracker

    stats_tracker.get(workflow_context.stat_scope()).scalar(**stats)


def _judge(traj: dict[str, Any], *, drop_zero_variance: bool) -> bool:
    expected = expected_group_size()
    rows = traj["input_ids"].shape[0]
    stats = {"cua/group/rejected/incomplete": 0.0}
    if drop_zero_variance:
        stats["cua/group/rejected/zero_variance"] = 0.0
    accepted = True
    if rows != expected:
        log.warning("group rejected: %d of %s members returned a row", rows, expected)
        stats["cua/group/rejected/incomplete"] = 1.0
        accepted = False
    else:
        zero_variance = reward_spread(traj) <= zero_variance_tol()
        stats["cua/group/zero_variance"] = float(zero_variance)
        if zero_variance and drop_zero_variance:
            stats["cua/group/rejected/zero_variance"] = 1.0
            accepted = False
    stats["cua/group/accepted"] = float(accepted)
    _record(**stats)
    return accepted


def complete_groups(traj: dict[str, Any]) -> bool:
    """Accept a group only when every member returned a row (zero-variance groups are counted,
    not dropped). The expected size comes from ``$CUA_RL_GROUP_SIZE``."""
    return _judge(traj, drop_zero_variance=False)


def complete_varied_groups(traj: dict[str, Any]) -> bool:
    """``complete_groups``, and also drop groups whose rewards are all equal."""
    return _judge(traj, drop_zero_variance=True)
