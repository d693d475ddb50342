"""The negative controls as a training meets them (cua_rl/app/controls.py).

``ShiftedCreditWorkflow`` must change one thing only: the reward each episode of a group is
credited with, moved to the episode before it, in the group filter AReaL calls with the group's
rows. Checked through the workflow's own ``arun_episode`` (which puts the group's filter in the
context AReaL calls the filter in) against the production workflow in the same set-up.
"""

from __future__ import annotations

import contextvars
import importlib

import pytest
import torch
from areal.infra import workflow_context
from areal.utils.data import concat_padded_tensors

from cua_rl.app.controls import ShiftedCreditFilter, ShiftedCreditWorkflow, shift_credit
from cua_rl.app.learn import CONTROLS, parse_args
from cua_rl.rollout import groups
from cua_rl.rollout.groups import GroupNormConfig, GroupSettings
from cua_rl.rollout.runtime import RolloutRuntime
from cua_rl.rollout.workflow import CUAAgentWorkflow
from tests.app.conftest import bare_settings

RAW = GroupNormConfig(mean_level="none", std_level="none")  # the filter writes rewards as given


def _row(reward: float, episode: int) -> dict:
    return {
        "input_ids": torch.zeros(1, 4, dtype=torch.long),
        "loss_mask": torch.tensor([[0, 0, 1, 1]], dtype=torch.int32),
        "logprobs": torch.zeros(1, 4),
        "attention_mask": torch.ones(1, 4, dtype=torch.bool),
        "rewards": torch.tensor([reward]),
        "episode_id": torch.tensor([episode]),
    }


def _group() -> dict:
    """Episodes 7 (two rows, reward 1), 8 (0) and 9 (0.5), as AReaL's grouped workflow joins them."""
    return concat_padded_tensors([_row(1.0, 7), _row(1.0, 7), _row(0.0, 8), _row(0.5, 9)])


@pytest.fixture(autouse=True)
def _rollout_context():
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))


def test_shift_credit_gives_every_row_the_next_episode_s_reward():
    traj = shift_credit(_group())
    assert traj["rewards"].tolist() == [0.0, 0.0, 0.5, 1.0]
    assert traj["episode_id"].tolist() == [7, 7, 8, 9]
    assert traj["loss_mask"].tolist() == _group()["loss_mask"].tolist()


def test_the_filter_normalises_the_shifted_rewards():
    norm = GroupNormConfig()  # production's: centred and scaled within the group
    traj = _group()
    assert ShiftedCreditFilter(GroupSettings(size=3, norm=norm)).complete_groups(traj)
    expected = groups.normalised([0.0, 0.5, 1.0], norm)
    assert traj["rewards"].tolist() == pytest.approx([expected[0], *expected])
    assert not ShiftedCreditFilter(GroupSettings(size=4, norm=norm)).complete_groups(_group())


@pytest.mark.parametrize(
    ("workflow", "rewards"),
    [(CUAAgentWorkflow, [1.0, 1.0, 0.0, 0.5]), (ShiftedCreditWorkflow, [0.0, 0.0, 0.5, 1.0])],
)
def test_the_control_s_episodes_are_judged_with_shifted_credit(workflow, rewards):
    settings = bare_settings(group=GroupSettings(size=3, norm=RAW))
    runtime = RolloutRuntime(settings)

    def as_areal_calls():  # the group's arun_episode calls, then the filter, in one context
        episode = workflow(settings, processor=object(), runtime=runtime).arun_episode(None, {})
        episode.close()  # never started: the filter is entered before the episode runs
        traj = _group()
        assert groups.complete_groups(traj)
        return traj["rewards"].tolist()

    assert contextvars.copy_context().run(as_areal_calls) == rewards


def test_every_control_names_a_workflow_and_the_bare_flag_picks_shifted_credit():
    for path in CONTROLS.values():
        module, name = path.rsplit(".", 1)
        assert issubclass(getattr(importlib.import_module(module), name), CUAAgentWorkflow)
    assert parse_args(["--control"]).control == "shifted-credit"
    assert parse_args(["--control", "shifted-mask"]).control == "shifted-mask"
    assert parse_args([]).control is None
