"""Replay's decision (``cua_rl.warehouse.replay``) and the group filter that applies it, without
an engine: groups of rows as AReaL's grouped workflow concatenates them, a worker's pool filled
by hand, stats under the rollout scope. The rows of a real recorded success are checked against
its replay on the real stack in test_replay_stack.py."""

from __future__ import annotations

import random

import pytest
import torch
from areal.utils import stats_tracker
from areal.utils.data import concat_padded_tensors

from cua_rl.errors import ConfigError
from cua_rl.rollout import groups
from cua_rl.rollout.groups import GroupFilter, GroupSettings
from cua_rl.warehouse import replay
from cua_rl.warehouse.replay import Recorded, ReplayConfig, choose

TASK, OTHER = "sim-019-learn-hard-wifi-on", "sim-020-learn-hard-wifi-off"
RUN = "this-run"
_ids = iter(range(5000, 10**6))


def _row(reward: float, episode: int, *, token: int = 0, version: int = 0, n: int = 5) -> dict:
    return {
        "input_ids": torch.full((1, n), token, dtype=torch.long),
        "loss_mask": torch.tensor([[0] * (n - 2) + [1, 1]], dtype=torch.int32),
        "logprobs": torch.tensor([[0.0] * (n - 2) + [-0.5, -1.5]]),
        "versions": torch.tensor([[-1] * (n - 2) + [version, version]], dtype=torch.int32),
        "attention_mask": torch.ones(1, n, dtype=torch.bool),
        "rewards": torch.tensor([reward]),
        "episode_id": torch.tensor([episode]),
    }


def _recorded(task=TASK, version=3, training=RUN, reward=1.0, rows=1, n=7) -> Recorded:
    eid = next(_ids)
    return Recorded(
        task_id=task,
        episode_id=eid,
        training=training,
        reward=reward,
        version_min=version,
        version_max=version,
        rows=tuple(_row(reward, eid, token=9, version=version, n=n) for _ in range(rows)),
    )


def _on(**changes) -> ReplayConfig:
    return ReplayConfig(enabled=True, **changes)


# ---- the decision -----------------------------------------------------------------------------


def test_an_all_fail_group_takes_the_newest_success_of_its_task_in_place_of_its_last_episode():
    old, new = _recorded(version=2), _recorded(version=4)
    plan = choose(TASK, [0.0] * 4, 5, [old, new], _on(), trainings=[RUN])
    assert plan.replace == (3,) and plan.recorded == (new,)
    two = choose(TASK, [0.0] * 4, 5, [old, new], _on(per_group=2), trainings=[RUN])
    assert two.replace == (2, 3) and two.recorded == (new, old)


def test_replay_never_uses_another_tasks_success():
    assert not choose(TASK, [0.0] * 4, 5, [_recorded(task=OTHER)], _on(), trainings=[RUN])


@pytest.mark.parametrize("max_age, used", [(1, False), (2, True), (3, True)])
def test_replay_never_uses_a_success_older_than_the_max_age(max_age, used):
    # Sampled at version 3, the group at 5: two versions old.
    plan = choose(TASK, [0.0] * 4, 5, [_recorded(version=3)], _on(max_age_versions=max_age))
    assert bool(plan) is used


def test_replay_leaves_groups_with_variance_all_successes_and_disabled_configs_alone():
    success = [_recorded()]
    assert not choose(TASK, [0.0, 1.0, 0.0, 0.0], 5, success, _on())
    assert not choose(TASK, [1.0] * 4, 5, success, _on())  # no better episode to put in
    assert not choose(TASK, [0.0] * 4, 5, success, ReplayConfig(enabled=False))
    assert not choose(TASK, [0.0] * 4, 5, [], _on())


def test_replay_draws_only_from_the_named_trainings():
    elsewhere = _recorded(training="another-run")
    assert not choose(TASK, [0.0] * 4, 5, [elsewhere], _on(), trainings=[RUN])
    assert choose(TASK, [0.0] * 4, 5, [elsewhere], _on(), trainings=[RUN, "another-run"])


def test_a_group_always_keeps_a_fresh_episode():
    many = [_recorded() for _ in range(5)]
    plan = choose(TASK, [0.0] * 3, 5, many, _on(per_group=2, pool_per_task=8))
    assert len(plan.recorded) == 2
    plan = choose(TASK, [0.0] * 2, 5, many, _on(per_group=4, pool_per_task=8))
    assert plan.replace == (1,)


# ---- the group filter -------------------------------------------------------------------------


@pytest.fixture
def worker():
    """The rollout scope's stats from a clean start; each test builds its runtime's filter (a
    ``GroupFilter``: the settings and a pool of its own)."""
    stats_tracker.get("rollout").export(reset=True)


def _stats() -> dict[str, float]:
    out = stats_tracker.get("rollout").export(reset=True)
    return {k.removeprefix("rollout/"): v for k, v in out.items()}


def _failed_group(pool, task=TASK, version=5, size=4) -> tuple[dict, list[int]]:
    ids = []
    rows = []
    for _ in range(size):
        eid = next(_ids)
        pool.note(eid, task, version)
        ids.append(eid)
        rows.append(_row(0.0, eid, version=version))
    return concat_padded_tensors(rows), ids


def test_the_filter_turns_an_all_fail_group_into_one_with_variance(worker):
    gf = GroupFilter(GroupSettings(size=4, replay=_on(), training=RUN))
    success = _recorded(version=3)
    gf.pool.add(success)
    traj, ids = _failed_group(gf.pool)
    assert gf.complete_varied_groups(traj)  # rescued, so not dropped for zero variance
    episodes, _, rows = groups.episode_rewards(traj)
    assert episodes == [*ids[:3], success.episode_id]
    advantages = traj["rewards"].tolist()
    assert advantages[-1] > 0 and all(a < 0 for a in advantages[:-1])
    mine = rows[-1][0]
    n = int(traj["attention_mask"][mine].sum())
    for key in ("input_ids", "loss_mask", "logprobs", "versions"):
        assert torch.equal(traj[key][mine, :n], success.rows[0][key][0]), key
    stats = _stats()
    assert {k: v for k, v in stats.items() if not k.endswith("__count")} == pytest.approx(
        {
            "cua/group/accepted": 1.0,
            "cua/group/rejected/incomplete": 0.0,
            "cua/group/rejected/zero_variance": 0.0,
            "cua/group/zero_variance": 0.0,
            "cua/group/rows_per_episode": 1.0,
            "cua/replay/all_fail": 1.0,
            "cua/replay/rescued": 1.0,
            "cua/replay/episodes": 1.0,
            "cua/replay/age": 2.0,
        }
    )


def test_the_filter_replays_nothing_from_another_task_or_past_the_max_age(worker):
    gf = GroupFilter(GroupSettings(size=4, replay=_on(max_age_versions=1), training=RUN))
    gf.pool.add(_recorded(task=OTHER, version=5))
    gf.pool.add(_recorded(task=TASK, version=3))  # two versions old
    traj, ids = _failed_group(gf.pool)
    assert not gf.complete_varied_groups(traj)
    assert groups.episode_rewards(traj)[0] == ids
    stats = _stats()
    assert stats["cua/replay/all_fail"] == 1.0 and stats["cua/replay/rescued"] == 0.0


def test_a_group_that_succeeded_entirely_is_not_counted_as_all_fail(worker):
    gf = GroupFilter(GroupSettings(size=2, replay=_on(), training=RUN))
    gf.pool.add(_recorded(reward=2.0))  # even a better-paid success is not put in
    ids = [next(_ids), next(_ids)]
    for eid in ids:
        gf.pool.note(eid, TASK, 5, success=True)
    traj = concat_padded_tensors([_row(1.0, eid) for eid in ids])
    assert gf.complete_groups(traj)
    assert groups.episode_rewards(traj)[0] == ids
    stats = _stats()
    assert stats["cua/replay/all_fail"] == 0.0 and "cua/replay/rescued" not in stats


def test_a_group_of_episodes_this_worker_did_not_run_is_counted_not_guessed(worker):
    gf = GroupFilter(GroupSettings(size=2, replay=_on(), training=RUN))
    gf.pool.add(_recorded())
    traj = concat_padded_tensors([_row(0.0, next(_ids)), _row(0.0, next(_ids))])
    assert gf.complete_groups(traj)
    stats = _stats()
    assert stats["cua/replay/unknown_task"] == 1.0 and "cua/replay/rescued" not in stats


def test_the_shuffled_control_moves_the_replayed_credit(worker):
    # Over many groups the control's permutation credits a fresh (failed) episode 3 times in 4.
    gf = GroupFilter(GroupSettings(size=4, replay=_on(shuffle_rewards=True, seed=1), training=RUN))
    gf.pool.add(_recorded())
    credited_replay = 0
    for _ in range(40):
        traj, _ = _failed_group(gf.pool)
        assert gf.complete_groups(traj)
        advantages = traj["rewards"].tolist()
        assert sum(a > 0 for a in advantages) == 1
        credited_replay += advantages[-1] > 0
    assert 0 < credited_replay < 25


def test_the_monitor_is_told_which_rollout_a_replay_replaced():
    mine, theirs = _recorded(version=3), _recorded(version=4, training="another-run")
    mine = replay.Recorded(**{**mine.__dict__, "rollout_uuid": "uuid-success"})
    seen = [replay.Seen(TASK, 5, f"uuid-{i}", False) for i in range(4)]
    plan = replay.Plan((2, 3), (mine, theirs))
    notes = replay.monitor_notes(plan, seen, 5, RUN)
    assert [n["client_id"] for n in notes] == ["uuid-2", "uuid-success", "uuid-3"]
    assert notes[0]["status_message"] == (
        f"not trained: replaced by the replayed success uuid-success (2 versions old, "
        f"training {RUN})"
    )
    assert notes[1]["status_message"] == "replayed into an all-fail group at version 5"
    assert "training another-run" in notes[2]["status_message"]


def test_shuffled_is_a_permutation():
    rng = random.Random(0)
    out = replay.shuffled([1.0, 0.0, 0.0, 0.5], rng)
    assert sorted(out) == [0.0, 0.0, 0.5, 1.0]


# ---- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"per_group": 0}, "replay.per_group=0 must be >= 1"),
        ({"max_age_versions": -1}, "replay.max_age_versions=-1 must be >= 0"),
        ({"per_group": 3, "pool_per_task": 2}, "keep at least as many successes per task"),
        ({"trainings": [""]}, "must be non-empty run names"),
    ],
)
def test_bad_replay_settings_say_how_to_fix_them(changes, says):
    with pytest.raises(ConfigError, match=says):
        ReplayConfig(**changes)


def test_replay_is_off_by_default_and_keeps_a_fresh_episode_per_group():
    assert ReplayConfig().enabled is False
    ReplayConfig(per_group=4).check_group_size(4)  # off: not checked
    with pytest.raises(ConfigError, match="must be below gconfig.n_samples=4"):
        ReplayConfig(enabled=True, per_group=4).check_group_size(4)
