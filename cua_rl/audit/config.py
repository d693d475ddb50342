"""The ``audit:`` section of the training config: what ``python -m cua_rl.audit`` runs.

The audit reads the training's own config (the gym, its task source and selection, the
rollout's concurrency bound, the monitor), so a user audits exactly the tasks they train on;
this section holds only what is the audit's own: which scripted agents, how many repeats, how
many random actions, where the JSON goes.
"""

from __future__ import annotations

from dataclasses import dataclass

from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError

AGENTS = ("stop", "wait", "random", "infeasible", "replay")
SCOPES = ("selected", "all")


@dataclass
class AuditConfig:
    agents: list[str] = doc(
        factory=lambda: list(AGENTS),
        help="The scripted agents run on every task: stop (stop at once), wait (screenshots "
        "only, then stop), random (random actions, then stop), infeasible (answer that the task "
        "cannot be done), replay (a recorded success or the task's known solution, and the same "
        "with one state-changing action removed)",
    )
    repeats: int = doc(
        3, "Runs of each action sequence on fresh boxes; different rewards: a flaky verifier"
    )
    wait_steps: int = doc(3, "Screenshots the wait agent takes before it stops")
    random_actions: int = doc(5, "Random actions of one random sequence")
    random_sequences: int = doc(2, "Random sequences per task (each run `repeats` times)")
    seed: int = doc(0, "Seed of the random sequences")
    infeasible_answer: str = doc(
        "infeasible",
        "The claim-infeasible agent's final answer, for tasks whose detail names none "
        "(evaluation.infeasible_answer)",
    )
    replay_trainings: list[str] = doc(
        factory=list,
        help="Trainings (monitor run names) whose recorded successes are replayed; empty: any "
        "training the monitor holds",
    )
    replays_per_task: int = doc(1, "Recorded successes replayed per task (newest first)")
    max_ablations: int = doc(
        8,
        "State-changing actions removed, one at a time, from a replayed success (its last "
        "ones); every removal still rewarded flags the task",
    )
    concurrency: int = doc(
        0, "Boxes open at once; 0: rollout.max_concurrent_rollouts, the rollout's own bound"
    )
    scope: str = doc(
        "selected",
        "selected: the train and eval tasks gym.selection picks (what the training sees); "
        "all: every task of the task source",
    )
    out: str = doc("", "The JSON report; empty: {cluster.fileroot}/audits/{gym_id}-{time}.json")

    def __post_init__(self) -> None:
        unknown = [a for a in self.agents if a not in AGENTS]
        if unknown or not self.agents:
            raise ConfigError(
                f"audit.agents={self.agents!r}: use some of {', '.join(AGENTS)} (e.g. "
                "audit.agents=[stop,wait])"
            )
        for name in ("repeats", "wait_steps", "random_actions", "random_sequences"):
            if getattr(self, name) < 1:
                raise ConfigError(f"audit.{name}={getattr(self, name)} must be at least 1")
        if self.replays_per_task < 1 or self.max_ablations < 0:
            raise ConfigError(
                "audit.replays_per_task must be >= 1 and audit.max_ablations >= 0 (0: no ablation)"
            )
        if self.concurrency < 0:
            raise ConfigError(
                f"audit.concurrency={self.concurrency} must be >= 0 (0: the rollout's bound)"
            )
        if self.scope not in SCOPES:
            raise ConfigError(f"audit.scope={self.scope!r}: use selected or all")
