"""The training's own monitor records: training, tasks, steps, baseline and evals.

``PPOTrainer.train`` is synchronous and has no step callback, so this module gives the launcher a
synchronous facade (``TrainingMonitor``) over the async ``MonitorClient``, running on a private
event loop in a daemon thread: every method enqueues records and returns at once, and nothing
here raises into training. ``cua_rl.areal.hooks.TrainerHooks`` calls it from the few points the
trainer exposes.

Ids: the training's client id is its run name; steps, evals and baselines use the formats of
``cua_rl.monitor.protocol``, so the rollout workers derive them without asking the server.
Step ``n`` is AReaL's ``global_step + 1``; rollouts sampled by policy version ``v`` are recorded
under step ``v + 1`` (the step that trains them when off-policyness is 0).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

from cua_rl.logs import get_logger
from cua_rl.monitor.protocol import (
    CANCELLED,
    COMPLETED,
    FAILED,
    ROLLOUT_RUNNING,
    RUNNING,
    baseline_client_id,
    eval_client_id,
    step_client_id,
)
from cua_rl.monitor.worker.batches import utc_now
from cua_rl.monitor.worker.client import MonitorClient, MonitorClientConfig

log = get_logger(__name__)

# How often a running training refreshes its heartbeat (the dashboard's default stale flag is
# at 300 s).
HEARTBEAT_S = 30.0


# AReaL stat keys -> step columns. Each entry lists candidates in order of preference: the key
# names moved between AReaL releases and depend on the loss in use.
STEP_COLUMNS: dict[str, tuple[str, ...]] = {
    "loss": ("ppo_actor/update/actor_loss/avg", "ppo_actor/update/loss/avg"),
    "kl_divergence": ("ppo_actor/update/approx_kl/avg", "ppo_actor/approx_kl/avg"),
    "policy_gradient_norm": ("ppo_actor/update/grad_norm", "ppo_actor/update/grad_norm/avg"),
    "learning_rate": ("ppo_actor/update/lr", "ppo_actor/update/lr/avg"),
    "reward_mean": ("rollout/cua/reward", "ppo_actor/task_reward/avg", "rollout/reward"),
    # Rows, not episodes (an episode gives a row per run of consistent calls): replaced by the
    # step's episode count when the monitor knows it (TrainingMonitor's episodes_per_step).
    "num_trajectories": ("ppo_actor/n_seqs", "ppo_actor/update/n_seqs"),
    # Trained (loss-masked) tokens of the step, summed over its rows.
    "num_tokens": ("ppo_actor/n_valid_tokens", "ppo_actor/update/n_valid_tokens"),
}


def _first(stats: Mapping[str, Any], keys: Iterable[str]) -> float | None:
    for k in keys:
        v = stats.get(k)
        if isinstance(v, int | float) and math.isfinite(float(v)):
            return float(v)
    return None


def _clean(stats: Mapping[str, Any]) -> dict[str, float]:
    """JSON-safe numbers only (NaN/inf would make the batch invalid JSON)."""
    out = {}
    for k, v in stats.items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out[str(k)] = f
    return out


def step_fields(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Step columns from one commit's merged stats (pure; tested without a trainer)."""
    fields: dict[str, Any] = {}
    for column, keys in STEP_COLUMNS.items():
        v = _first(stats, keys)
        if v is not None:
            fields[column] = int(v) if column.startswith("num_") else v
    # AReaL's rollout stats arrive as means over episodes (counts are dropped when the workers'
    # stats are merged), so the workflow logs reward and reward^2 and the spread is derived here.
    mean = _first(stats, ("rollout/cua/reward",))
    sq = _first(stats, ("rollout/cua/reward_sq",))
    if mean is not None and sq is not None:
        fields["reward_std"] = math.sqrt(max(sq - mean * mean, 0.0))
    return fields


def eval_fields(stats: Mapping[str, Any], prefix: str = "eval-rollout") -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for column, key in (
        ("success_rate", f"{prefix}/cua/success"),
        ("avg_reward", f"{prefix}/cua/reward"),
        ("avg_turns", f"{prefix}/cua/turns"),
    ):
        v = _first(stats, (key,))
        if v is not None:
            fields[column] = v
    fields["metrics_json"] = {k: v for k, v in _clean(stats).items() if k.startswith(prefix)}
    return fields


def _as_json(config: Any) -> Any:
    """The config as the monitor stores it (``config_json``); None when it is no dataclass."""
    try:
        return json.loads(json.dumps(asdict(config), default=str))
    except Exception:
        return None


def _changed_keys(before: Any, after: Any, prefix: str = "") -> list[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        keys = sorted(set(before) | set(after))
        return [
            c for k in keys for c in _changed_keys(before.get(k), after.get(k), f"{prefix}{k}.")
        ]
    return [] if before == after else [prefix.rstrip(".") or "(config)"]


class TrainingMonitor:
    """Synchronous, never-raising recorder of one training run."""

    def __init__(
        self,
        client_config: MonitorClientConfig | None,
        run_name: str,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        episodes_per_step: int | None = None,
    ):
        self.run = run_name
        self.heartbeat_s = heartbeat_s
        # A step trains whole groups: batch_size tasks x n_samples episodes, however many rows.
        self.episodes_per_step = episodes_per_step
        self._started = False
        self._beat: asyncio.Task | None = None
        self.enabled = client_config is not None
        self._cfg = client_config
        self._client: MonitorClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._step_started: set[int] = set()
        # Evals and the baseline that started and have not finished: a run that dies closes them.
        self._open_evals: set[int] = set()
        self._baseline_open = False
        # The phase steps last set: an evaluation's end gives it back (the baseline runs after
        # the first step has opened, so no step event would).
        self._step_phase: str | None = None
        self._finished = False
        self._config_json: Any = None  # what config_json last recorded

    # ------------------------------------------------------------------ plumbing

    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._client = MonitorClient(self._cfg)
            loop.run_until_complete(self._client.start())
            self._beat = loop.create_task(self._heartbeat())
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="cua-monitor", daemon=True)
        self._thread.start()
        ready.wait(10)

    async def _heartbeat(self) -> None:
        # A long rollout phase sends nothing else for minutes; the dashboard flags a running
        # training whose heartbeat is old, so a hung or killed trainer shows as stale.
        while not self._finished:
            await asyncio.sleep(self.heartbeat_s)
            if self._started and not self._finished:
                self._training()

    async def _stop_heartbeat(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            await asyncio.gather(self._beat, return_exceptions=True)

    def _send(self, kind: str, record: dict[str, Any]) -> None:
        if self._client is None:
            return
        try:
            self._client.enqueue(kind, record)
        except Exception as exc:  # the client does not raise; this guards a broken record
            log.warning("monitor: %s record not sent: %s", kind, exc)

    def flush(self, timeout: float = 10.0) -> bool:
        if self._client is None or self._loop is None:
            return True
        fut = asyncio.run_coroutine_threadsafe(self._client.flush(timeout), self._loop)
        try:
            return bool(fut.result(timeout + 5))
        except Exception:
            return False

    def close(self, timeout: float = 10.0) -> None:
        if self._client is None or self._loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._stop_heartbeat(), self._loop).result(5)
        except Exception as exc:
            log.warning("monitor: heartbeat did not stop: %s", exc)
        fut = asyncio.run_coroutine_threadsafe(self._client.close(timeout), self._loop)
        try:
            fut.result(timeout + 10)
        except Exception as exc:
            log.warning("monitor: close: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._client = None

    @property
    def counters(self) -> dict[str, Any]:
        return self._client.counters.as_dict() if self._client else {}

    # ------------------------------------------------------------------ training

    def training_started(self, *, config: Any, total_steps: int | None, **fields: Any) -> None:
        config_json = self._config_json = _as_json(config)
        gconfig = getattr(config, "gconfig", None)
        actor = getattr(config, "actor", None)
        record = {
            "run_name": self.run,
            "log_path": fields.pop("log_path", ""),
            "model_name": getattr(actor, "path", "") or "",
            "learning_rate": getattr(getattr(actor, "optimizer", None), "lr", None),
            "batch_size": getattr(getattr(config, "train_dataset", None), "batch_size", None),
            "group_size": getattr(gconfig, "n_samples", None),
            "max_tokens": getattr(gconfig, "max_new_tokens", None),
            "temperature": getattr(gconfig, "temperature", None),
            "kl_penalty_coef": getattr(actor, "kl_ctl", None),
            "max_turns": getattr(getattr(config, "agent", None), "max_steps", None),
            "seed": getattr(config, "seed", None),
            "status": RUNNING,
            "current_phase": "initialization",
            "total_steps": total_steps,
            "start_time": utc_now(),
            "last_heartbeat": utc_now(),
            "config_json": config_json,
            **fields,
        }
        self._send("training", {k: v for k, v in record.items() if v is not None})
        self._started = True

    def config_ran(self, config: Any) -> list[str]:
        """The config as the trainer starts to train: recorded again when it differs from the
        one ``training_started`` recorded (the trainer may amend it as it builds its workers).
        The keys that changed, dotted."""
        now = _as_json(config)
        changed = _changed_keys(self._config_json, now)
        if changed:
            self._config_json = now
            log.info("the config changed after it was recorded (%s): recorded again", changed)
            self._training(config_json=now)
        return changed

    def _training(self, **fields: Any) -> None:
        if fields.get("current_phase") not in (None, "evaluation"):
            self._step_phase = fields["current_phase"]
        self._send("training", {"run_name": self.run, "last_heartbeat": utc_now(), **fields})

    def tasks(self, rows: Iterable[Mapping[str, Any]]) -> int:
        n = 0
        for row in rows:
            task_id = str(row["task_id"])
            record = {
                "client_id": task_id,
                "task_id": task_id,
                "name": str(row.get("name") or task_id),
                "description": str(row.get("description") or row.get("instruction") or ""),
                "tags": list(row.get("tags") or []),
                "source_type": row.get("split"),
            }
            self._send("tasks", {k: v for k, v in record.items() if v is not None})
            n += 1
        return n

    def training_finished(self) -> None:
        if not self._finished:
            self._finished = True
            self._training(
                status=COMPLETED,
                current_phase="completed",
                progress_percent=100.0,
                end_time=utc_now(),
            )

    def training_failed(self, error: BaseException | str) -> None:
        if self._finished:
            return
        self._finished = True
        # A stop the training decided itself (SystematicRejection) is a failure, not a cancel.
        cancelled = isinstance(error, KeyboardInterrupt) and not getattr(error, "is_failure", False)
        message = str(error) if isinstance(error, str) else f"{type(error).__name__}: {error}"
        status = CANCELLED if cancelled else FAILED
        ended = {"status": status, "error_message": message[:4000]}
        for step in sorted(self._open_evals):
            self._send("evals", {**self._eval_ref(step), **ended, "end_time": utc_now()})
        self._open_evals.clear()
        if self._baseline_open:
            self._send("baselines", {**self._baseline_ref(), **ended, "end_time": utc_now()})
            self._baseline_open = False
        self._training(
            status=status,
            error_message=message[:4000],
            status_message=f"interrupted ({error or 'Ctrl-C'})" if cancelled else "failed",
            end_time=utc_now(),
        )

    # ------------------------------------------------------------------ steps

    def _step_ref(self, step: int) -> dict[str, Any]:
        return {
            "client_id": step_client_id(self.run, step),
            "training_client_id": self.run,
            "step": step,
        }

    def step_started(self, step: int, *, total_steps: int | None = None) -> None:
        if step in self._step_started:
            return
        self._step_started.add(step)
        now = utc_now()
        self._send(
            "steps",
            {
                **self._step_ref(step),
                "batch": 0,
                "status": ROLLOUT_RUNNING,
                "current_phase": "rollout_execution",
                "start_time": now,
                "rollout_start_time": now,
            },
        )
        progress = None
        if total_steps:
            progress = 100.0 * (step - 1) / total_steps
        self._training(current_step=step, current_phase="rollout", progress_percent=progress)

    def step_phase(self, step: int, status: str, phase: str, **fields: Any) -> None:
        self._send(
            "steps",
            {
                **self._step_ref(step),
                "status": status,
                "current_phase": phase,
                **fields,
            },
        )
        training_phase = {"training": "training", "checkpointing": "checkpointing"}.get(phase)
        if training_phase:
            self._training(current_phase=training_phase)

    def step_committed(self, step: int, stats: Mapping[str, Any], *, total_steps: int | None):
        now = utc_now()
        self._send(
            "steps",
            {
                **self._step_ref(step),
                "status": COMPLETED,
                "current_phase": "completed",
                "progress_percent": 100.0,
                "end_time": now,
                "training_end_time": now,
                **step_fields(stats),
                **({"num_trajectories": self.episodes_per_step} if self.episodes_per_step else {}),
                "metrics_json": _clean(stats),
            },
        )
        progress = 100.0 * step / total_steps if total_steps else None
        self._training(current_step=step, progress_percent=progress)

    def step_failed(self, step: int, error: BaseException) -> None:
        if step not in self._step_started:
            return
        self.step_phase(
            step, FAILED, "failed", error_message=f"{type(error).__name__}: {error}"[:4000]
        )

    # ------------------------------------------------------------------ evals

    def _eval_ref(self, step: int) -> dict[str, Any]:
        return {
            "client_id": eval_client_id(self.run, step),
            "training_client_id": self.run,
            "step": step,
        }

    def _baseline_ref(self) -> dict[str, Any]:
        return {"client_id": baseline_client_id(self.run), "training_client_id": self.run}

    def eval_started(self, step: int, *, model_path: str, total_tasks: int | None) -> None:
        self._open_evals.add(step)
        self._send(
            "evals",
            {
                **self._eval_ref(step),
                "model_path": model_path,
                "status": RUNNING,
                "current_phase": "rollout",
                "total_tasks": total_tasks,
                "start_time": utc_now(),
            },
        )
        self._training(current_phase="evaluation")

    def eval_finished(
        self, step: int, stats: Mapping[str, Any], *, total_tasks: int | None = None
    ) -> None:
        now = utc_now()
        counts = {}
        if total_tasks and "success_rate" in eval_fields(stats):
            rate = eval_fields(stats)["success_rate"]
            counts = {"completed_tasks": total_tasks, "successful_tasks": round(rate * total_tasks)}
        self._open_evals.discard(step)
        self._send(
            "evals",
            {
                **self._eval_ref(step),
                "status": COMPLETED,
                "progress_percent": 100.0,
                "current_phase": "aggregation",
                "end_time": now,
                "eval_time": now,
                **eval_fields(stats),
                **counts,
            },
        )
        self._end_evaluation()

    def baseline_started(self, *, model_path: str, total_tasks: int | None) -> None:
        self._baseline_open = True
        self._send(
            "baselines",
            {
                **self._baseline_ref(),
                "model_path": model_path,
                "status": RUNNING,
                "current_phase": "rollout",
                "total_tasks": total_tasks,
                "start_time": utc_now(),
            },
        )
        self._training(current_phase="evaluation", status_message="baseline evaluation")

    def baseline_finished(self, stats: Mapping[str, Any], *, error: str | None = None) -> None:
        now = utc_now()
        self._baseline_open = False
        record: dict[str, Any] = {**self._baseline_ref(), "end_time": now}
        if error:
            record.update(status=FAILED, error_message=error[:4000])
        else:
            record.update(
                status=COMPLETED, progress_percent=100.0, eval_time=now, **eval_fields(stats)
            )
        self._send("baselines", record)
        # "baseline evaluation" would otherwise stay the training's message for the whole run.
        self._training(status_message=None)
        self._end_evaluation()

    def _end_evaluation(self) -> None:
        """The training's phase back to its step's once no evaluation is open."""
        if not self._open_evals and not self._baseline_open and self._step_phase is not None:
            self._training(current_phase=self._step_phase)
