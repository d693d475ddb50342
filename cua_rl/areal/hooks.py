"""Hooks on AReaL's ``PPOTrainer`` that mark a step's phases and evals in the monitor.

``PPOTrainer.train`` has no step callback, so ``TrainerHooks.attach`` wraps the few entry points
AReaL 1.0.4 exposes: ``stats_logger.commit`` (one call per finished step, with the merged stats),
the actor's ``ppo_update`` / ``update_weights`` (the step's phases) and ``_evaluate_fn`` (an eval
pass). Each wrapper records, then calls the original; recording never changes what the trainer
does or raises into it. The names wrapped are listed in ``cua_rl.areal.support``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cua_rl.audit.live import log_step
from cua_rl.logs import get_logger
from cua_rl.monitor.worker.batches import utc_now
from cua_rl.monitor.worker.training import TrainingMonitor, _clean

log = get_logger(__name__)


class TrainerHooks:
    """Wraps the few trainer entry points that mark step phases and evals.

    Each wrapper records, then calls the original; recording never changes what the trainer does
    or raises into it.
    """

    def __init__(
        self,
        monitor: TrainingMonitor,
        *,
        total_steps: int | None,
        model_path: str,
        eval_tasks: int | None,
        learning_rate: float | None = None,
        step_stats: Callable[[], Mapping[str, float]] | None = None,
    ):
        self.learning_rate = learning_rate
        # Stats kept outside AReaL's trackers (the curriculum's), merged into each commit.
        self.step_stats = step_stats
        self._n_rows: int | None = None
        self.monitor = monitor
        self.total_steps = total_steps
        self.model_path = model_path
        self.eval_tasks = eval_tasks
        self.current_step = 1
        self.committed: list[tuple[int, dict[str, float]]] = []

    def _safe(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # a monitor bug must not stop training
            log.warning("monitor hook failed: %s", exc)

    def _extra_stats(self) -> dict[str, float]:
        try:
            return dict(self.step_stats())
        except Exception as exc:  # a stats bug must not stop training
            log.warning("step stats failed: %s", exc)
            return {}

    def attach(self, trainer: Any) -> None:
        m = self.monitor
        # A run resumed by AReaL's recover goes on with the step after the last checkpoint.
        recovered = trainer.recover_info
        if recovered is not None:
            self.current_step = int(recovered.last_step_info.global_step) + 2
        first = self.current_step
        self._safe(lambda: m.step_started(first, total_steps=self.total_steps))

        commit = trainer.stats_logger.commit

        def on_commit(epoch, epoch_step, global_step, data, *a, **kw):
            if self.step_stats is not None and isinstance(data, dict):
                data = {**data, **self._extra_stats()}
            result = commit(epoch, epoch_step, global_step, data, *a, **kw)
            stats = data[0] if isinstance(data, list) and data else data
            stats = dict(stats or {})
            step = int(global_step) + 1
            # What AReaL 1.0.4 does not log: the step's row count (seen in ppo_update) and the
            # learning rate (constant schedules log nothing).
            if self._n_rows is not None:
                stats.setdefault("ppo_actor/n_seqs", self._n_rows)
                self._n_rows = None
            if self.learning_rate is not None:
                stats.setdefault("ppo_actor/update/lr", self.learning_rate)
            self.committed.append((step, _clean(stats)))
            self._safe(lambda: m.step_committed(step, stats, total_steps=self.total_steps))
            # Rewarded episodes in which no action changed the state: say so (docs/audit.md).
            self._safe(lambda: log_step(step, stats))
            if any(k.startswith("eval-rollout/") for k in stats):
                self._safe(lambda: m.eval_finished(step, stats, total_tasks=self.eval_tasks))
            nxt = step + 1
            if self.total_steps is None or nxt <= self.total_steps:
                self.current_step = nxt
                self._safe(lambda: m.step_started(nxt, total_steps=self.total_steps))
            return result

        trainer.stats_logger.commit = on_commit

        actor = trainer.actor
        for name, status, phase in (
            ("ppo_update", "training", "training"),
            ("update_weights", "training", "checkpointing"),
        ):
            original = getattr(actor, name)

            def wrapped(*a, _orig=original, _status=status, _phase=phase, **kw):
                fields = {"training_start_time": utc_now()} if _phase == "training" else {}
                if _phase == "training":
                    fields["rollout_end_time"] = fields["training_start_time"]
                    batch = a[0] if a else kw.get("data")
                    if isinstance(batch, list | tuple):
                        self._n_rows = len(batch)
                self._safe(lambda: m.step_phase(self.current_step, _status, _phase, **fields))
                return _orig(*a, **kw)

            setattr(actor, name, wrapped)

        evaluate_fn = trainer._evaluate_fn

        def on_eval(*a, **kw):
            step = self.current_step
            self._safe(
                lambda: m.eval_started(
                    step, model_path=self.model_path, total_tasks=self.eval_tasks
                )
            )
            return evaluate_fn(*a, **kw)

        # The baseline pass calls the original: it has a record of its own, not an eval's.
        on_eval.__wrapped__ = evaluate_fn
        trainer._evaluate_fn = on_eval
