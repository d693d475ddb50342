"""The group filters as AReaL's rollout worker calls them: one group's rows, stats under the
rollout scope."""

from __future__ import annotations

import pytest
import torch
from areal.utils import stats_tracker

from cua_rl.errors import ConfigError
from cua_rl.rollout.groups import (
    COMPLETE_GROUPS,
    COMPLETE_VARIED_GROUPS,
    GROUP_SIZE_ENV,
    ZERO_VARIANCE_TOL_ENV,
    complete_groups,
    complete_varied_groups,
)


def _group(*rewards: float) -> dict:
    n = len(rewards)
    return {"input_ids": torch.zeros(n, 5, dtype=torch.long), "rewards": torch.tensor(rewards)}


@pytest.fixture
def stats(monkeypatch):
    monkeypatch.setenv(GROUP_SIZE_ENV, "4")
    monkeypatch.delenv(ZERO_VARIANCE_TOL_ENV, raising=False)
    stats_tracker.get("rollout").export(reset=True)

    def export() -> dict[str, float]:
        # The keys the step's stats carry are these under "rollout/".
        out = stats_tracker.get("rollout").export(reset=True)
        return {k.removeprefix("rollout/"): v for k, v in out.items()}

    yield export


GROUPS = [
    _group(1.0, 0.0, 0.0, 1.0),  # varied
    _group(0.0, 0.0, 0.0, 0.0),  # all failed
    _group(-0.05, -0.05, -0.05, -0.05),  # all equal under shaping
    _group(1.0, 0.0, 1.0),  # lost a member
]


def test_complete_groups_drops_incomplete_groups_and_only_counts_zero_variance(stats):
    assert [complete_groups(g) for g in GROUPS] == [True, True, True, False]
    s = stats()
    assert s["cua/group/accepted"] == pytest.approx(3 / 4)
    assert s["cua/group/rejected/incomplete"] == pytest.approx(1 / 4)
    # Two of the three complete groups had equal rewards; none was dropped for it.
    assert s["cua/group/zero_variance"] == pytest.approx(2 / 3)
    assert not any("rejected/zero_variance" in k for k in s)


def test_complete_varied_groups_also_drops_and_counts_zero_variance(stats):
    assert [complete_varied_groups(g) for g in GROUPS] == [True, False, False, False]
    s = stats()
    assert s["cua/group/accepted"] == pytest.approx(1 / 4)
    assert s["cua/group/rejected/zero_variance"] == pytest.approx(2 / 4)
    assert s["cua/group/rejected/incomplete"] == pytest.approx(1 / 4)
    assert s["cua/group/zero_variance"] == pytest.approx(2 / 3)


def test_the_tolerance_decides_what_equal_means(stats, monkeypatch):
    near = _group(0.5, 0.5 + 1e-7, 0.5, 0.5)  # float32, like the rows
    assert not complete_varied_groups(near)
    monkeypatch.setenv(ZERO_VARIANCE_TOL_ENV, "0")
    assert complete_varied_groups(near)
    monkeypatch.setenv(ZERO_VARIANCE_TOL_ENV, "lots")
    with pytest.raises(ConfigError, match=ZERO_VARIANCE_TOL_ENV):
        complete_varied_groups(near)


def test_the_group_size_must_be_set(monkeypatch):
    monkeypatch.delenv(GROUP_SIZE_ENV, raising=False)
    with pytest.raises(ConfigError, match=GROUP_SIZE_ENV):
        complete_groups(GROUPS[0])
    monkeypatch.setenv(GROUP_SIZE_ENV, "four")
    with pytest.raises(ConfigError, match="not an integer"):
        complete_groups(GROUPS[0])


def test_the_dotted_paths_resolve_to_the_filters():
    import importlib

    import cua_rl.rollout.workflow as workflow

    for path, fn in (
        (COMPLETE_GROUPS, complete_groups),
        (COMPLETE_VARIED_GROUPS, complete_varied_groups),
    ):
        module, name = path.rsplit(".", 1)
        assert getattr(importlib.import_module(module), name) is fn
    # The example's old dotted path still works.
    assert workflow.complete_groups is complete_groups
