"""Negative controls: workflows with a deliberate training bug that must stop the learning.

A curve that rises proves little unless the same run with a plausible bug stays flat. Name a
control in the config (``workflow: cua_rl.app.controls.ShiftedMaskWorkflow``) to get it.

``ShiftedMaskWorkflow`` moves each row's loss mask one token later, the off-by-one a mask laid on
the labels instead of the inputs would make. Every row still has the right shape, logprobs and
versions, and trains on sampled tokens; but the first token of each reply, the one that decides
where the local agent taps in the learn family (docs/learning.md), is never trained.
"""

from __future__ import annotations

from cua_rl.rollout.episode import CapturedCalls, EpisodeTask
from cua_rl.rollout.workflow import CUAAgentWorkflow
from cua_rl.trajectory import ConversionResult


def shift_mask_right(mask):
    """The mask one token later along the last axis; the last position's flag is dropped."""
    shifted = mask.clone()
    shifted[..., 0] = 0
    shifted[..., 1:] = mask[..., :-1]
    return shifted


class ShiftedMaskWorkflow(CUAAgentWorkflow):
    """The production workflow with each row's loss mask shifted one token later."""

    async def build_rows(self, task: EpisodeTask, calls: CapturedCalls, reward) -> ConversionResult:
        result = await super().build_rows(task, calls, reward)
        if result.row is not None:
            result.row["loss_mask"] = shift_mask_right(result.row["loss_mask"])
        return result
