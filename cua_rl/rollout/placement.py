"""Where one episode's monitor records belong, derived from the rollout's phase and version."""

from __future__ import annotations

from cua_rl.monitor.protocol import baseline_client_id, eval_client_id, step_client_id
from cua_rl.monitor.worker.context import MonitorContext


def rollout_source(training_ref: str, phase: str, is_eval: bool, version: int) -> MonitorContext:
    """Where an episode's rollout record belongs: the baseline pass, the eval pass of policy
    ``version``, or the step that trains it (policy version v is trained by step v + 1; train.py
    opens that step's record first). No training reference: not recorded against one."""
    if not training_ref:
        return MonitorContext()
    if phase == "baseline":
        return MonitorContext(
            training_id=training_ref, baseline_id=baseline_client_id(training_ref)
        )
    if phase == "eval" or is_eval:
        return MonitorContext(
            training_id=training_ref, eval_id=eval_client_id(training_ref, version)
        )
    return MonitorContext(
        training_id=training_ref, step_id=step_client_id(training_ref, version + 1)
    )


def is_surplus(phase: str, is_eval: bool, total_steps: int, version: int) -> bool:
    """A training rollout of a policy the run never trains again: the trainer prefetches a batch
    after the last step, and those episodes belong to no step record (0 steps: unknown)."""
    return phase == "train" and not is_eval and bool(total_steps) and version + 1 > total_steps
