"""The group filters as AReaL's rollout worker calls them: one group's rows (a variable number per
episode), stats under the rollout scope, rewards normalised per episode."""

from __future__ import annotations

import contextvars
import math

import pytest
import torch
from areal.api.cli_args import NormConfig, PPOActorConfig
from areal.trainer.ppo.actor import PPOActor
from areal.utils import stats_tracker
from areal.utils.data import concat_padded_tensors

from cua_rl.errors import ConfigError
from cua_rl.rollout import groups
from cua_rl.rollout.groups import (
    COMPLETE_GROUPS,
    COMPLETE_VARIED_GROUPS,
    GroupNormConfig,
    GroupSettings,
    complete_groups,
    complete_varied_groups,
)

_next_id = iter(range(1000, 10**6))


def _row(reward: float, episode: int, n_sampled: int = 2, prompt: int = 3) -> dict:
    n = prompt + n_sampled
    return {
        "input_ids": torch.zeros(1, n, dtype=torch.long),
        "loss_mask": torch.tensor([[0] * prompt + [1] * n_sampled], dtype=torch.int32),
        "logprobs": torch.zeros(1, n),
        "attention_mask": torch.ones(1, n, dtype=torch.bool),
        "rewards": torch.tensor([reward]),
        "episode_id": torch.tensor([episode]),
    }


def _group(*episodes: float | tuple[float, int]) -> dict:
    """Episodes as reward or (reward, rows), concatenated as AReaL's grouped workflow does."""
    rows = []
    for ep in episodes:
        reward, n = ep if isinstance(ep, tuple) else (ep, 1)
        eid = next(_next_id)
        rows += [_row(reward, eid) for _ in range(n)]
    return concat_padded_tensors(rows)


@pytest.fixture
def settings():
    """A runtime's filter with these settings, in the test's context as an episode's call of
    ``arun_episode`` puts it (the settings are the filter's own: a test may change them)."""
    s = GroupSettings(size=4)
    token = groups.enter(groups.GroupFilter(s))
    yield s
    groups.leave(token)


@pytest.fixture
def stats(settings):
    stats_tracker.get("rollout").export(reset=True)

    def export() -> dict[str, float]:
        # The keys the step's stats carry are these under "rollout/".
        out = stats_tracker.get("rollout").export(reset=True)
        return {k.removeprefix("rollout/"): v for k, v in out.items()}

    yield export


def _groups():
    return [
        _group(1.0, 0.0, 0.0, 1.0),  # varied
        _group((0.0, 3), 0.0, (0.0, 8), 0.0),  # all failed, 13 rows
        _group(-0.05, -0.05, -0.05, -0.05),  # all equal under shaping
        _group((1.0, 2), (0.0, 1), (1.0, 1)),  # lost a member, although 4 rows
    ]


def test_complete_groups_counts_episodes_not_rows_and_only_counts_zero_variance(stats):
    assert [complete_groups(g) for g in _groups()] == [True, True, True, False]
    s = stats()
    assert s["cua/group/accepted"] == pytest.approx(3 / 4)
    assert s["cua/group/rejected/incomplete"] == pytest.approx(1 / 4)
    # Two of the three complete groups had equal rewards; none was dropped for it.
    assert s["cua/group/zero_variance"] == pytest.approx(2 / 3)
    assert not any("rejected/zero_variance" in k for k in s)
    assert s["cua/group/rows_per_episode"] == pytest.approx((1 + 13 / 4 + 1 + 4 / 3) / 4)


def test_complete_varied_groups_also_drops_and_counts_zero_variance(stats):
    assert [complete_varied_groups(g) for g in _groups()] == [True, False, False, False]
    s = stats()
    assert s["cua/group/accepted"] == pytest.approx(1 / 4)
    assert s["cua/group/rejected/zero_variance"] == pytest.approx(2 / 4)
    assert s["cua/group/rejected/incomplete"] == pytest.approx(1 / 4)
    assert s["cua/group/zero_variance"] == pytest.approx(2 / 3)


def test_every_row_gets_its_episodes_normalised_reward(settings):
    g = _group((1.0, 3), (0.0, 1), (0.0, 8), (1.0, 2))
    assert complete_groups(g)
    # By hand: mean 0.5, unbiased std sqrt(4 * 0.25 / 3), eps 1e-5.
    adv = 0.5 / (math.sqrt(1 / 3) + 1e-5)
    expected = [adv] * 3 + [-adv] * 1 + [-adv] * 8 + [adv] * 2
    assert g["rewards"].tolist() == pytest.approx(expected, abs=1e-6)
    assert g["rewards"].dtype == torch.float32


def test_leave_one_out_and_no_scaling(settings):
    settings.norm = GroupNormConfig(mean_leave1out=True, std_level="none")
    g = _group((1.0, 2), 0.0, 0.0, 0.0)
    assert complete_groups(g)
    # Episode 1: 1 - mean(0, 0, 0) = 1; the others: 0 - 1/3.
    assert g["rewards"].tolist() == pytest.approx([1.0, 1.0, -1 / 3, -1 / 3, -1 / 3])


def test_the_tolerance_decides_what_equal_means(settings):
    near = _group(0.5, 0.5 + 1e-7, 0.5, 0.5)  # float32, like the rows
    assert not complete_varied_groups(near)
    settings.zero_variance_tol = 0.0
    assert complete_varied_groups(_group(0.5, 0.5 + 1e-7, 0.5, 0.5))


def test_bad_groups_and_missing_settings_are_errors(settings):
    mixed = concat_padded_tensors([_row(1.0, 7), _row(0.0, 7)])
    with pytest.raises(ValueError, match="different rewards"):
        complete_groups(mixed)
    no_ids = _group(1.0, 0.0, 0.0, 1.0)
    del no_ids["episode_id"]
    with pytest.raises(ConfigError, match="episode_id"):
        complete_groups(no_ids)
    # In a context no episode ran in, the filter refuses rather than guesses settings.
    with pytest.raises(ConfigError, match="no runtime"):
        contextvars.Context().run(complete_groups, _group(1.0, 0.0, 0.0, 1.0))


def test_bad_norm_levels_are_refused():
    with pytest.raises(ConfigError, match="group_norm.mean_level='batch'"):
        GroupNormConfig(mean_level="batch")


def _episodes_rows(split: bool, rewards, tokens) -> list[dict]:
    """Each episode as its rows (``split``) or as one row holding the same sampled tokens."""
    rows = []
    for e, (reward, parts) in enumerate(zip(rewards, tokens, strict=True)):
        if split:
            rows += [_row(reward, e, n_sampled=t) for t in parts]
        else:
            rows.append(_row(reward, e, n_sampled=sum(parts)))
    return rows


def _actor(reward_norm: NormConfig | None) -> PPOActor:
    cfg = PPOActorConfig(
        experiment_name="x",
        trial_name="y",
        path="",
        kl_ctl=0.0,
        reward_norm=reward_norm,
        adv_norm=NormConfig(mean_level="batch", std_level="batch"),
    )
    return PPOActor(cfg, engine=None)


def _advantages_per_episode(batch: dict) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    mask = batch["loss_mask"]  # rolled by the actor: the token before each sampled one
    for i, e in enumerate(batch["episode_id"].tolist()):
        out.setdefault(e, []).extend(batch["advantages"][i][mask[i] > 0].tolist())
    return out


def test_variable_rows_get_the_advantages_one_row_per_episode_gets(settings):
    """On the tensors AReaL's PPO actor receives: episodes of 1, 3 and 8 rows (and a second group)
    get the per-episode advantages AReaL's own group normalisation gives one row per episode."""
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]
    tokens = [[[3], [2, 4, 1], [1] * 8, [5, 2]], [[2, 2, 2], [6], [1] * 8, [4]]]
    variable, oracle = [], []
    for r, t in zip(rewards, tokens, strict=True):
        group = concat_padded_tensors(_episodes_rows(True, r, t))
        assert complete_groups(group)  # the filter normalises in the rollout worker
        variable.append(group)
        oracle.append(concat_padded_tensors(_episodes_rows(False, r, t)))
    ours = _actor(None).compute_advantages(variable)
    areal = _actor(NormConfig(mean_level="group", std_level="group", group_size=4))
    theirs = areal.compute_advantages(oracle)
    for mine, ref in zip(ours, theirs, strict=True):
        got, want = _advantages_per_episode(mine), _advantages_per_episode(ref)
        assert got.keys() == want.keys()
        for e in want:
            # The same tokens with the same advantage: one value per episode.
            assert sorted(got[e]) == pytest.approx(sorted(want[e]), abs=1e-5)
            assert len(set(round(a, 5) for a in got[e])) == 1
    # The control: the same variable rows under AReaL's fixed chunks of 4 rows differ.
    naive = [
        concat_padded_tensors(_episodes_rows(True, r, t))
        for r, t in zip(rewards, tokens, strict=True)
    ]
    wrong = areal.compute_advantages(naive)
    assert any(
        sorted(_advantages_per_episode(w)[e])
        != pytest.approx(sorted(_advantages_per_episode(r)[e]))
        for w, r in zip(wrong, theirs, strict=True)
        for e in range(4)
    )


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
