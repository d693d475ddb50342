"""Who observes an episode, in one list, and how an observer is kept out of the episode's way.

Each cross-cutting feature owns its observer, an ``EpisodeObserver`` (``cua_rl.rollout.episode``:
one method per event kind) in its own module, and ``observers_of`` lists them, in the order each
event reaches them:

- ``StatsObserver`` (here): the scalars AReaL averages over a step's episodes (counts are per
  episode; ``reward_sq`` lets the spread be derived) and the worker's outcome file (failfast);
- ``FreeRewardObserver`` (``cua_rl.audit.live``): a rewarded episode none of whose actions
  changed the state, in the step's stats and on its rollout (before the monitor's observer,
  which completes the rollout);
- ``PauseObserver`` (``cua_rl.rollout.service_pauses``): a rejection that is its service's failure
  pauses new episodes;
- ``MonitorObserver`` (``cua_rl.monitor.worker.observer``): the rollout, its environment,
  validation, turns, actions and screenshots, through a recorder it opens itself;
- ``WarehouseObserver`` (``cua_rl.warehouse.store``): an accepted train episode stored for
  rebuilding (``monitor.store_episodes``);
- ``CreditObserver`` (``cua_rl.credit.observer``, with ``step_credit.enabled``, train episodes):
  each accepted episode's steps, for its group's step credit;
- ``ReplayObserver`` (``cua_rl.warehouse.replay``): the replay pool learns each train episode's
  task and keeps successes for later all-fail groups.

The drain's ``LiveEpisode`` observes every episode too (the workflow puts it first). An observer
cannot change an episode's outcome: ``Observers`` tells each in turn and keeps what one raises
(logged once per observer and event kind, counted as ``cua/observer_errors/<name>``), so the
others are still told and the episode ends as it would have. A new observer is one module and
one line in ``observers_of`` (docs/conventions.md, *Add an observer*).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cua_rl.audit.live import FreeRewardObserver
from cua_rl.core.reasons import HOOK_PREFIX
from cua_rl.credit.observer import CreditObserver
from cua_rl.logs import get_logger
from cua_rl.monitor.worker.observer import MonitorObserver
from cua_rl.rollout.episode import (
    CaptureClosed,
    Converted,
    Ended,
    EpisodeEvent,
    EpisodeObserver,
    Evaluated,
)
from cua_rl.rollout.outcomes import OutcomeLog
from cua_rl.rollout.runtime import EpisodeScope
from cua_rl.rollout.service_pauses import PauseObserver
from cua_rl.warehouse.replay import ReplayObserver
from cua_rl.warehouse.store import WarehouseObserver

log = get_logger(__name__)


def observers_of(episode: EpisodeScope) -> list[EpisodeObserver]:
    """The observers of ``episode`` (its task, settings, runtime and event loop's clients), in the
    order each event reaches them. A new cross-cutting feature adds its observer here."""
    s, loop = episode.settings, episode.loop
    ledger = episode.runtime.groups.ledger
    # Step credit: the rows' steps (converted) go in the ledger before replay keeps a success
    # (ended).
    credit = (
        [CreditObserver(ledger, s.group.step_credit, episode.task, episode.stat_scope)]
        if s.group.step_credit.enabled and s.phase == "train"
        else []
    )
    monitor = MonitorObserver(episode.monitor, s, episode.task, episode.is_eval, loop.http())
    return [
        StatsObserver(episode.stat_scope, s.phase, episode.runtime.outcomes),
        FreeRewardObserver(episode.stat_scope, lambda: monitor.recorder),
        PauseObserver(loop.pauses, episode.task.task_id, s.phase, episode.engine.choose_server),
        monitor,
        WarehouseObserver(
            episode.monitor,
            episode.task,
            policy=s.store_episodes,
            phase=s.phase,
            training=s.training_ref,
        ),
        *credit,
        ReplayObserver(
            episode.runtime.replay,
            s.group.replay,
            training=s.group.training,
            phase=s.phase,
            processor=episode.processor,
            monitor=loop.monitor_client,
            ledger=ledger if s.group.step_credit.enabled else None,
            step_credit=s.group.step_credit,
        ),
    ]


def observer_name(observer: Any) -> str:
    """The name its errors are counted under: its ``name``, else its class's."""
    return getattr(observer, "name", "") or type(observer).__name__


class Observers:
    """The episode's observers, told each event in turn (the pipeline's ``emit``). What one raises
    (not cancellation) is counted under ``stat_scope`` as ``cua/observer_errors/<name>`` and
    logged with its traceback the first time an observer raises at an event kind
    (``first_time``: the runtime's memory), and the next observer is told."""

    def __init__(
        self,
        observers: Sequence[Any],
        *,
        stat_scope: str,
        first_time: Callable[[tuple], bool],
    ):
        self.observers = list(observers)
        self.stat_scope = stat_scope
        self.first_time = first_time

    async def __call__(self, event: EpisodeEvent) -> None:
        for observer in self.observers:
            try:
                await observer.on(event)
            except Exception as exc:
                self.failed(observer, event, exc)

    def failed(self, observer: Any, event: EpisodeEvent, exc: Exception) -> None:
        from areal.utils import stats_tracker

        name = observer_name(observer)
        stats_tracker.get(self.stat_scope).scalar(**{f"cua/observer_errors/{name}": 1.0})
        if self.first_time(("observer", name, event.kind)):
            log.error(
                "observer %s raised at %s (logged once per observer and event kind, counted as "
                "cua/observer_errors/%s; the episode goes on as if it had not)",
                name,
                event.kind,
                name,
                exc_info=exc,
            )


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


class StatsObserver(EpisodeObserver):
    """Stats under AReaL's rollout or eval-rollout scope (``scope``, read at the episode's start)
    and the outcome log; once per episode that ended (a cancelled one is not counted). A hook's
    rejection also writes its detail (the exception, the hook) for failfast's line."""

    name = "stats"

    def __init__(self, scope: str, phase: str, outcomes: OutcomeLog | None):
        self.scope, self.phase, self.outcomes = scope, phase, outcomes
        self.reward = self.rows = self.capture_stats = None

    async def capture_closed(self, event: CaptureClosed) -> None:
        if event.capture is not None:
            self.capture_stats = event.capture.counters

    async def evaluated(self, event: Evaluated) -> None:
        self.reward = event.reward

    async def converted(self, event: Converted) -> None:
        self.rows = event.rows

    async def ended(self, event: Ended) -> None:
        if event.outcome == "cancelled":
            return
        from areal.utils import stats_tracker

        stats = episode_stats(event, self.reward, self.rows, self.capture_stats)
        stats_tracker.get(self.scope).scalar(**stats)
        if self.outcomes is not None:
            reason = None if event.accepted else event.reason
            hook = bool(reason) and reason.startswith(HOOK_PREFIX)
            self.outcomes.record(
                accepted=reason is None,
                reason=reason,
                phase=self.phase,
                detail=event.detail if hook else "",
            )
