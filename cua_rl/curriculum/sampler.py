"""The curriculum as the train data loader's sampler, in the trainer (controller) process.

AReaL's controller pulls task rows from its train ``StatefulDataLoader`` whenever it has room
for more rollouts; the loader asks its sampler for ``batch_size`` indices at a time. This
sampler answers each such request with a fresh ``select_batch`` on the outcomes the monitor has
recorded by then, so the tasks of every step's batch (and of the extra draws that replace
rejected groups) come from the selector. It is lazy: nothing is drawn before it is asked.

Its state is small: the number of batches drawn and the indices of a batch not yet handed out.
The loader's ``state_dict`` carries it into AReaL's recover checkpoint, and a resumed run goes on
with the next batch index; the outcomes themselves stay in the monitor. Every draw (the
estimates it used, the tasks chosen) and every saved or loaded state can be appended to a JSONL
decision log, so a run's batches can be checked against its recorded outcomes.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import Sampler

from cua_rl.curriculum.outcomes import OutcomeSource
from cua_rl.curriculum.selector import (
    CurriculumConfig,
    Outcome,
    TaskEstimate,
    estimate_tasks,
    informative_probability,
    select_batch,
)
from cua_rl.errors import ConfigError, MonitorError
from cua_rl.logs import get_logger

log = get_logger(__name__)

STATE_FORMAT = 1


def tasks_digest(task_ids: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(task_ids).encode()).hexdigest()[:16]


class _EpochIterator(Iterator[int]):
    """One pass of ``len(sampler)`` indices; its position is part of the loader's state."""

    def __init__(self, sampler: CurriculumSampler):
        self.sampler = sampler
        self.yielded = 0

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> int:
        if self.yielded >= len(self.sampler):
            raise StopIteration
        index = self.sampler.next_index()
        self.yielded += 1
        return index

    def state_dict(self) -> dict[str, Any]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.yielded = int(state.get("yielded", 0))


class CurriculumSampler(Sampler[int]):
    """Indices of train tasks, drawn batch by batch by the UCB selector."""

    def __init__(
        self,
        task_ids: Sequence[str],
        *,
        config: CurriculumConfig,
        source: OutcomeSource,
        batch_size: int,
        group_size: int,
        seed: int,
        drop_last: bool = True,
        log_path: str | Path | None = None,
    ):
        super().__init__()
        self.task_ids = [str(t) for t in task_ids]
        if len(set(self.task_ids)) != len(self.task_ids):
            raise ConfigError("the curriculum needs unique task ids in the train dataset")
        if not 1 <= batch_size <= len(self.task_ids):
            raise ConfigError(
                f"curriculum: train_dataset.batch_size={batch_size} must be between 1 and the "
                f"number of train tasks ({len(self.task_ids)}): a batch holds distinct tasks"
            )
        self.config = config
        self.source = source
        self.batch_size = batch_size
        self.group_size = group_size
        self.seed = seed
        self.drop_last = drop_last
        self.log_path = Path(log_path) if log_path else None
        self.batches_drawn = 0
        self.pending: list[int] = []
        self._outcomes: list[Outcome] = []
        self._estimates: list[TaskEstimate] = [TaskEstimate() for _ in self.task_ids]
        self._step: dict[str, Any] = self._new_step_stats()
        self._log_failed = False
        # Indices in the draws below are positions in this list.
        self._log({"event": "tasks", "task_ids": self.task_ids, "seed": seed})

    # ------------------------------------------------------------------ sampler protocol

    def __len__(self) -> int:
        n = len(self.task_ids)
        return n - n % self.batch_size if self.drop_last else n

    def __iter__(self) -> _EpochIterator:
        return _EpochIterator(self)

    def next_index(self) -> int:
        if not self.pending:
            self.pending = list(self.draw())
        return self.pending.pop(0)

    # ------------------------------------------------------------------ drawing

    def refresh(self) -> str | None:
        """Read the outcomes again; on failure keep the last ones and return the error."""
        try:
            self._outcomes = self.source.fetch()
        except MonitorError as exc:
            log.warning("curriculum: outcomes not read, using the last ones: %s", exc)
            self._step["fetch_errors"] += 1
            return str(exc)
        self._estimates = estimate_tasks(self.task_ids, self._outcomes, decay=self.config.decay)
        return None

    def draw(self) -> tuple[int, ...]:
        """The next batch of dataset indices."""
        error = self.refresh()
        estimates = self._estimates
        selection = select_batch(
            estimates,
            self.batch_size,
            group_size=self.group_size,
            config=self.config,
            seed=self.seed,
            batch_index=self.batches_drawn,
        )
        never_tried = sum(1 for e in estimates if e.tries == 0)
        p = [
            estimates[i].success(self.config.prior_successes, self.config.prior_failures)
            for i in selection.indices
        ]
        s = self._step
        s["draws"] += 1
        s["sampled_success"].extend(p)
        s["sampled_informative"].extend(informative_probability(x, self.group_size) for x in p)
        s["floor_slots"] += selection.by.count("floor")
        s["slots"] += len(selection.indices)
        s["never_tried"] = never_tried
        s["tries"] = sum(e.tries for e in estimates)
        self._log(
            {
                "event": "draw",
                "batch": self.batches_drawn,
                "seed": self.seed,
                "latest_version": max((o.version for o in self._outcomes), default=None),
                "estimates": {
                    t: [e.tries, e.successes, e.weight, e.weighted_successes]
                    for t, e in zip(self.task_ids, estimates, strict=True)
                    if e.tries
                },
                "indices": list(selection.indices),
                "chosen": [self.task_ids[i] for i in selection.indices],
                "by": list(selection.by),
                "never_tried": never_tried,
                "fetch_error": error,
            }
        )
        self.batches_drawn += 1
        return selection.indices

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs (the outcomes stay in the monitor)."""
        return {
            "format": STATE_FORMAT,
            "seed": self.seed,
            "batches_drawn": self.batches_drawn,
            "pending": list(self.pending),
            "tasks": tasks_digest(self.task_ids),
        }

    def state_dict(self) -> dict[str, Any]:
        # The loader asks for it only when AReaL writes a recover checkpoint.
        state = self.state()
        self._log({"event": "state_saved", "state": state})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ConfigError(
                f"the recovered curriculum state has format {state.get('format')!r}, this "
                f"version reads {STATE_FORMAT}; start a new trial or set curriculum.kind=uniform"
            )
        if int(state["seed"]) != self.seed:
            log.warning(
                "curriculum: the checkpoint was drawn with seed %s, this run uses %s",
                state["seed"],
                self.seed,
            )
        self.batches_drawn = int(state["batches_drawn"])
        pending = [int(i) for i in state.get("pending", [])]
        if state.get("tasks") != tasks_digest(self.task_ids):
            # Indices would name other tasks; the outcomes are keyed by task id and still hold.
            log.warning("curriculum: the train tasks changed since the checkpoint")
            pending = []
        self.pending = pending
        self._log({"event": "state_loaded", "state": self.state()})

    # ------------------------------------------------------------------ stats and log

    @staticmethod
    def _new_step_stats() -> dict[str, Any]:
        return {
            "draws": 0,
            "sampled_success": [],
            "sampled_informative": [],
            "floor_slots": 0,
            "slots": 0,
            "never_tried": None,
            "tries": None,
            "fetch_errors": 0,
        }

    def pop_step_stats(self) -> dict[str, float]:
        """Stats of the draws since the previous call (train.py calls it once per step)."""
        s, self._step = self._step, self._new_step_stats()
        never_tried = s["never_tried"]
        if never_tried is None:
            never_tried = sum(1 for e in self._estimates if e.tries == 0)
        out = {
            "curriculum/draws": float(s["draws"]),
            "curriculum/batches_drawn": float(self.batches_drawn),
            "curriculum/never_tried": float(never_tried),
            "curriculum/never_tried_share": never_tried / len(self.task_ids),
            "curriculum/fetch_errors": float(s["fetch_errors"]),
        }
        if s["tries"] is not None:
            out["curriculum/recorded_tries"] = float(s["tries"])
        if s["sampled_success"]:
            out["curriculum/sampled_success"] = _mean(s["sampled_success"])
            out["curriculum/sampled_informative"] = _mean(s["sampled_informative"])
            out["curriculum/floor_share"] = s["floor_slots"] / s["slots"]
        # Carry the latest counts into the next step's stats when it draws nothing new.
        self._step["never_tried"] = never_tried
        self._step["tries"] = s["tries"]
        return out

    def _log(self, record: dict[str, Any]) -> None:
        if self.log_path is None or not self.config.log_decisions:
            return
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"time": time.time(), **record}) + "\n")
        except OSError as exc:
            if not self._log_failed:
                self._log_failed = True
                log.warning("curriculum: decision log %s not written: %s", self.log_path, exc)

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if callable(close):
            close()


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)
