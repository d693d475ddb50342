"""Group filters for AReaL's ``dynamic_filter_fn`` (passed to ``trainer.train`` by dotted path).

AReaL's group normalisation slices fixed-size chunks of rows with no check, so a group that lost
a member would silently mix groups; ``complete_groups`` refuses such a group.
"""

from __future__ import annotations

import os
from typing import Any

from cua_rl.errors import ConfigError
from cua_rl.logs import get_logger

log = get_logger("cua_rl.groups")

GROUP_SIZE_ENV = "CUA_RL_GROUP_SIZE"


def complete_groups(traj: dict[str, Any]) -> bool:
    """``dynamic_filter_fn``: accept a group only when every member returned a row.

    AReaL's group normalisation slices fixed-size chunks of rows with no check, so a group that
    lost a member would mix groups. The expected size comes from ``$CUA_RL_GROUP_SIZE``, which
    train.py sets from ``gconfig.n_samples`` before any worker starts.
    """
    expected = os.environ.get(GROUP_SIZE_ENV)
    if not expected:
        raise ConfigError(
            f"complete_groups needs ${GROUP_SIZE_ENV} (the group size, gconfig.n_samples); "
            "train.py sets it: set it yourself when you use the filter elsewhere"
        )
    rows = traj["input_ids"].shape[0]
    if rows != int(expected):
        log.warning("group rejected: %d of %s members returned a row", rows, expected)
        return False
    return True
