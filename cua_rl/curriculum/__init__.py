"""Task curriculum: spend rollouts on the tasks the policy can learn from (docs/curriculum.md).

One GUI episode costs minutes of a box, an agent run and GPU time, and with GRPO a group whose
rewards are all equal (a task far too hard, or already solved) teaches nothing. The pieces:

- ``selector``: recorded outcomes per task and policy version -> estimates -> a UCB-style draw
  of the next batch's tasks, with a floor so no task starves (pure, deterministic for a seed);
- ``outcomes``: reads the outcomes from the Training Monitor, which every rollout worker already
  writes to and which outlives a restart (the selector keeps no outcomes of its own);
- ``sampler``: the train data loader's sampler in the trainer process; its small state rides
  in AReaL's recover checkpoint;
- ``trainer``: ``CurriculumPPOTrainer``, the one-method ``PPOTrainer`` subclass that installs it.

The group filters that count and drop zero-variance groups are in ``cua_rl.rollout.groups``. Only
``selector`` is imported here; the others import torch or AReaL.
"""

from cua_rl.curriculum.selector import (
    CurriculumConfig,
    Outcome,
    Selection,
    TaskEstimate,
    estimate_tasks,
    select_batch,
)

__all__ = [
    "CurriculumConfig",
    "Outcome",
    "Selection",
    "TaskEstimate",
    "estimate_tasks",
    "select_batch",
]
