"""Who observes an episode: the step's stats, the service pauses, the monitor, the warehouse, replay.

The pipeline (``cua_rl.rollout.episode``) emits what happens to an episode; each observer here
turns the events it cares for into its own records, in the order ``Observers`` holds them, and
none reaches into the pipeline's stages. ``StatsObserver``: the scalars AReaL averages over a
step's episodes (counts are per episode; ``reward_sq`` lets the spread be derived) and the
worker's outcome file (failfast). ``PauseObserver``: a rejection that is its service's failure
pauses new episodes (``cua_rl.rollout.service_pauses``). ``MonitorObserver``: the rollout, its
environment, validation, turns, actions and screenshots (docs/monitor.md); it never raises into
training. ``WarehouseObserver``: an accepted train episode stored for rebuilding
(``monitor.store_episodes``). ``ReplayObserver``: the replay pool learns each train episode's task
and keeps successes for later all-fail groups (``cua_rl.warehouse.replay``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from cua_rl.credit.observer import stored_steps
from cua_rl.errors import MonitorError
from cua_rl.logs import get_logger
from cua_rl.monitor.worker.recorder import RolloutRecorder
from cua_rl.monitor.worker.uploader import Fetch, http_fetcher
from cua_rl.rollout.drain import DRAIN_REASON
from cua_rl.rollout.episode import (
    AgentRan,
    BoxChanged,
    CaptureClosed,
    Converted,
    Ended,
    EpisodeEvent,
    EpisodeTask,
    Evaluated,
    Started,
)
from cua_rl.rollout.outcomes import OutcomeLog
from cua_rl.rollout.placement import is_surplus, rollout_source
from cua_rl.rollout.settings import WorkflowSettings
from cua_rl.trajectory.config import TrajectoryConfig
from cua_rl.warehouse import (
    RebuildError,
    StoredEpisodeError,
    rebuild_rows,
    replay,
    stored_episode_of,
    stored_from_rows,
)

log = get_logger(__name__)

# Per episode (AReaL averages them over a step's episodes): the step's sampled and trained tokens
# say whether every call was trained; rows and processed images what it cost.
ROW_STATS = (
    "turns",
    "rows",
    "trained_turns",
    "dropped_turns",
    "sampled_tokens",
    "trained_tokens",
    "row_tokens",
    "images",
    "distinct_images",
    "processed_images",
    "prefix_breaks",
    "row_len",
)


class Observers:
    """The episode's observers, told each event in turn (the pipeline's ``emit``)."""

    def __init__(self, *observers: Any):
        self.observers = list(observers)

    async def __call__(self, event: EpisodeEvent) -> None:
        for observer in self.observers:
            await observer.on(event)


def episode_stats(ended: Ended, reward=None, rows=None, capture_stats=None) -> dict[str, float]:
    """One episode's scalars (``cua/...``): accepted or its rejection reason, the reward, the
    rows' counts, the gateway's counts and the stages' seconds."""
    reason = None if ended.accepted else ended.reason
    stats: dict[str, float] = {"cua/accepted": 0.0 if reason else 1.0}
    if reason:
        stats[f"cua/rejected/{reason}"] = 1.0
    if reward is not None:
        stats["cua/reward"] = reward.reward
        stats["cua/reward_sq"] = reward.reward**2
        stats["cua/success"] = float(reward.success)
    if rows is not None:
        for key in ROW_STATS:
            if key in rows.stats:
                stats[f"cua/{key}"] = float(rows.stats[key])
    stats.update({f"cua/{k}": v for k, v in (capture_stats or {}).items()})
    for key, value in ended.timings.items():
        stats[f"cua/time/{key}"] = float(value)
    return stats


class StatsObserver:
    """Stats under AReaL's rollout or eval-rollout scope (``scope``, read at the episode's start)
    and the outcome log; once per episode that ended (a cancelled one is not counted)."""

    def __init__(self, scope: str, phase: str, outcomes: OutcomeLog | None):
        self.scope, self.phase, self.outcomes = scope, phase, outcomes
        self.reward = self.rows = self.capture_stats = None

    async def on(self, event: EpisodeEvent) -> None:
        if isinstance(event, CaptureClosed) and event.capture is not None:
            self.capture_stats = event.capture.counters
        elif isinstance(event, Evaluated):
            self.reward = event.reward
        elif isinstance(event, Converted):
            self.rows = event.rows
        elif isinstance(event, Ended) and event.outcome != "cancelled":
            from areal.utils import stats_tracker

            stats = episode_stats(event, self.reward, self.rows, self.capture_stats)
            stats_tracker.get(self.scope).scalar(**stats)
            if self.outcomes is not None:
                reason = None if event.accepted else event.reason
                self.outcomes.record(accepted=reason is None, reason=reason, phase=self.phase)


class PauseObserver:
    """A rejection that is a service's failure (the gym's create, the agent service's, a model
    server out) pauses new episodes: ``pause_for`` is the runtime's."""

    def __init__(self, pause_for: Callable[..., None], phase: str, choose_server: Callable):
        self.pause_for, self.phase, self.choose_server = pause_for, phase, choose_server
        self.created = self.agent_unavailable = False

    async def on(self, event: EpisodeEvent) -> None:
        if isinstance(event, BoxChanged) and event.box is not None:
            self.created = True
        elif isinstance(event, AgentRan):
            self.agent_unavailable = bool(event.run.summary.create_unavailable)
        elif isinstance(event, Ended) and event.outcome == "rejected":
            self.pause_for(
                event.error,
                phase=self.phase,
                task_id=event.task.task_id,
                created=self.created,
                agent_unavailable=self.agent_unavailable,
                choose_server=self.choose_server,
            )


class MonitorObserver:
    """The episode's records in the monitor, through its ``RolloutRecorder`` (disabled when the
    rollout is not recorded). Screenshots are downscaled and kept by the monitor (presigned URLs
    expire): the gateway's images, or those fetched from the agent's URLs with ``http`` under
    the trajectory's image policy (``images``: allowed hosts, size and time bounds)."""

    def __init__(self, recorder: RolloutRecorder, images: TrajectoryConfig, http: Any):
        self.recorder = recorder
        self.fetch: Fetch = http_fetcher(images, http)

    async def on(self, event: EpisodeEvent) -> None:
        r = self.recorder
        if isinstance(event, Started):
            await r.start()
        elif isinstance(event, BoxChanged):
            await self._environment(event)
        elif isinstance(event, Evaluated):
            await r.validation(
                success=event.reward.success,
                score=event.reward.base,
                details_json=event.evaluation.raw,
            )
        elif isinstance(event, Converted) and r.enabled:
            turns = event.calls.monitor_turns(event.rows.trained_steps)
            await r.record_turns(turns, images=event.calls.images(), fetch=self.fetch)
        elif isinstance(event, Ended):
            await self._ended(event)

    async def _environment(self, event: BoxChanged) -> None:
        if event.state == "running":
            await self.recorder.environment("running", gbox_id=event.box.box_id)
        elif event.state == "error" or event.cancelled:
            message = event.message if event.state == "error" else DRAIN_REASON
            await self.recorder.environment(event.state, status_message=message)
        else:
            await self.recorder.environment(event.state)

    async def _ended(self, event: Ended) -> None:
        if event.accepted:
            await self.recorder.complete(
                reward=event.reward.reward,
                task_success=int(event.reward.success),
                metrics_json={"conversion": event.rows.stats, "timings": dict(event.timings)},
            )
        elif event.outcome == "cancelled":
            await self.recorder.fail("cancelled", status_message=DRAIN_REASON)
        else:
            await self.recorder.fail(event.reason, error_message=str(event.error))


class WarehouseObserver:
    """Keep an accepted train episode in the trajectory warehouse (``monitor.store_episodes``:
    successes by default), so its rows can be rebuilt exactly for replay and export."""

    def __init__(self, recorder: RolloutRecorder, settings: WorkflowSettings):
        self.recorder, self.settings = recorder, settings

    async def on(self, event: EpisodeEvent) -> None:
        if not isinstance(event, Ended) or not event.accepted:
            return
        policy, success = self.settings.store_episodes, bool(event.reward.success)
        if not self.recorder.enabled or self.settings.phase != "train" or policy == "none":
            return
        if policy == "successes" and not success:
            return
        self.recorder.client.store_episode(
            stored_episode_of(
                event.rows,
                event.calls.turns,
                task_id=event.task.task_id,
                rollout_uuid=event.task.rollout_uuid,
                training=self.settings.training_ref,
                success=success,
            )
        )


class ReplayObserver:
    """With ``replay.enabled`` (train phase): tell the pool which task each accepted episode ran,
    keep a success's rows rebuilt from their stored form (what the warehouse keeps), and on a
    failure read the recorded successes of ``replay.trainings`` from the monitor (once per task
    and policy version). A failed read or rebuild is counted (``cua/replay/...``), never raised."""

    def __init__(
        self, pool: replay.ReplayPool, settings: WorkflowSettings, processor, monitor, ledger=None
    ):
        self.pool, self.settings = pool, settings
        self.processor = processor  # () -> the processor, loaded on first use
        self.monitor = monitor  # async () -> the monitor client, or None
        # With step credit, a success keeps its steps (cua_rl.credit): its own episodes' from
        # the worker's ledger, other trainings' read from the stored episode.
        self.ledger = ledger if settings.group.step_credit.enabled else None

    async def on(self, event: EpisodeEvent) -> None:
        cfg = self.settings.group.replay
        if not isinstance(event, Ended) or not event.accepted or not cfg.enabled:
            return
        if self.settings.phase != "train":
            return
        task, success = event.task, bool(event.reward.success)
        self.pool.note(
            task.episode_id, task.task_id, task.version, task.rollout_uuid, success=success
        )
        if not success:
            if cfg.trainings and self.pool.first_ask(task.task_id, task.version):
                await self.fetch(task.task_id, task.version)
            return
        rows = event.rows
        try:
            stored = stored_from_rows(
                rows.rows,
                rows.row_images,
                task_id=task.task_id,
                rollout_uuid=task.rollout_uuid,
                training=self.settings.group.training,
                success=True,
                images=rows.image_data,
                row_turns=rows.row_turns,
            )
            rebuilt = await asyncio.to_thread(rebuild_rows, stored, self.processor())
        except (RebuildError, StoredEpisodeError, KeyError) as exc:
            # The episode trains as it is; only its replay is lost, and counted.
            _replay_error("cua/replay/record_errors", task.task_id, exc)
            return
        steps = self.ledger.peek(task.episode_id) if self.ledger is not None else None
        self.pool.add(replay.recorded_of(stored, rebuilt, steps))

    async def fetch(self, task_id: str, version: int) -> None:
        """The recorded successes of ``task_id`` in the trainings ``replay.trainings`` names, from
        the monitor's episode store, rebuilt into the pool."""
        cfg = self.settings.group.replay
        client = await self.monitor()
        if client is None:
            return
        # Only what choose() can take: versions within max_age_versions of this one, none
        # ahead of it (a training further on than this one would fill the pool with successes
        # it can never use, pushing out its own), and never below 0 (the monitor refuses it).
        try:
            found = await client.successes(
                task_id,
                cfg.trainings,
                max(version - cfg.max_age_versions, 0),
                cfg.pool_per_task,
                max_version=version,
            )
            for stored in found:
                rows = await asyncio.to_thread(rebuild_rows, stored, self.processor())
                steps = None
                if self.ledger is not None:
                    cfg = self.settings.group.step_credit
                    steps = await asyncio.to_thread(stored_steps, stored, rows, cfg)
                self.pool.add(replay.recorded_of(stored, rows, steps))
        except (MonitorError, RebuildError, StoredEpisodeError) as exc:
            _replay_error("cua/replay/fetch_errors", task_id, exc)


def _replay_error(key: str, task_id: str, exc: Exception) -> None:
    from areal import workflow_context
    from areal.utils import stats_tracker

    stats_tracker.get(workflow_context.stat_scope()).scalar(**{key: 1.0})
    log.warning("replay of %s: %s: %s", task_id, key, exc)


async def recorder_for(
    clients, settings: WorkflowSettings, task: EpisodeTask, is_eval: bool
) -> RolloutRecorder:
    """The episode's monitor recorder (``clients``: the runtime's ``ServiceClients``). Disabled
    for a training rollout of a policy the run never trains: the trainer prefetches a batch
    after the last step, and it belongs to no step record."""
    s = settings
    surplus = is_surplus(s.phase, is_eval, s.total_steps, task.version)
    if surplus:
        log.info(
            "episode %s samples policy version %d after the last step: not recorded",
            task.rollout_uuid,
            task.version,
        )
    return RolloutRecorder(
        None if surplus else await clients.monitor_client(),
        task.rollout_uuid,
        task_id=task.task_id,
        model_path=s.processor_path,
        source=rollout_source(s.training_ref, s.phase, is_eval, task.version),
        task={
            "name": task.data.get("name") or task.task_id,
            "description": task.data.get("description") or "",
        },
    )
