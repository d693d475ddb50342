"""Negative controls: workflows with a deliberate training bug that must stop the learning.

A curve that rises proves little unless the same run with a plausible bug stays flat. Name a
control in the config (``workflow: cua_rl.app.controls.ShiftedCreditWorkflow``) to get it;
``make learn LEARN_ARGS="--control NAME"`` does (``cua_rl.app.learn.CONTROLS``).

``ShiftedCreditWorkflow`` gives each episode of a group the reward of the next episode (the last
gets the first's), the off-by-one of a gather that zipped a group's rewards with its rows one
place late. Rows, tokens, logprobs, masks and the group's statistics are untouched; only the
credit lands on another episode. A group's episodes are independent samples of one policy, so
the reward an episode is credited with does not depend on what it did, and no path through the
model carries the success's credit to the actions that earned it: the control cannot learn by
construction (docs/learning.md).

``ShiftedMaskWorkflow`` moves each row's loss mask one token later, the off-by-one a mask laid on
the labels instead of the inputs would make. The first token of each reply, the one that decides
where the local agent taps in the learn family, is never trained; but the later tokens are, with
the right advantages, and a tiny model's replies repeat their first token, so the credit can
reach the first token through the weights the positions share. It learned in some runs
(docs/learning.md): a control that shows what a mask bug does, not one a test can require flat.
"""

from __future__ import annotations

from typing import Any

from cua_rl.rollout import groups
from cua_rl.rollout.episode import CapturedCalls, EpisodeTask
from cua_rl.rollout.workflow import CUAAgentWorkflow
from cua_rl.trajectory import ConversionResult


def shift_mask_right(mask):
    """The mask one token later along the last axis; the last position's flag is dropped."""
    shifted = mask.clone()
    shifted[..., 0] = 0
    shifted[..., 1:] = mask[..., :-1]
    return shifted


def shift_credit(traj: dict[str, Any]) -> dict[str, Any]:
    """The group's rows with each episode's reward moved to the episode before it in row order
    (the first episode's to the last): every row of episode i carries episode i+1's reward."""
    _, rewards, rows = groups.episode_rewards(traj)
    out = traj["rewards"].clone()
    for i, idx in enumerate(rows):
        out[idx] = rewards[(i + 1) % len(rewards)]
    traj["rewards"] = out
    return traj


class ShiftedCreditFilter(groups.GroupFilter):
    """The production group filter, judging each group after ``shift_credit``."""

    def judge(self, traj: dict[str, Any], *, drop_zero_variance: bool) -> bool:
        return super().judge(shift_credit(traj), drop_zero_variance=drop_zero_variance)


class ShiftedCreditWorkflow(CUAAgentWorkflow):
    """The production workflow whose groups are judged by a ``ShiftedCreditFilter``."""

    def arun_episode(self, engine, data: dict[str, Any]):
        episode = super().arun_episode(engine, data)
        # After the runtime's own filter entered this context: the group's filter is this one.
        production = self.runtime.groups
        groups.enter(ShiftedCreditFilter(production.settings, production.pool, production.notes))
        return episode


class ShiftedMaskWorkflow(CUAAgentWorkflow):
    """The production workflow with each row's loss mask shifted one token later."""

    async def build_rows(self, task: EpisodeTask, calls: CapturedCalls, reward) -> ConversionResult:
        result = await super().build_rows(task, calls, reward)
        if result.row is not None:
            result.row["loss_mask"] = shift_mask_right(result.row["loss_mask"])
        return result
