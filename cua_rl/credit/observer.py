"""Step data of each accepted train episode, for its group's filter; and of replayed successes.

``CreditObserver`` watches one episode (an ``EpisodeObserver``, listed by
``cua_rl.rollout.observers.observers_of``): when its rows are built (``converted``) it reads
their steps in a thread (a perceptual hash per distinct screenshot) and puts them in the
worker's ``CreditLedger``. A failure is logged and counted (``cua/credit/errors``: the share of
episodes) and never reaches the episode, which then trains with its episode credit only (its
group counts it in ``cua/credit/unknown_episodes``).

``stored_steps`` reads the same from a stored episode (replay: the worker's own successes and
those of ``replay.trainings``), whose turns keep their actions and whose rows their layout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from cua_rl.credit.config import StepCreditConfig
from cua_rl.credit.ledger import CreditLedger
from cua_rl.credit.steps import EpisodeSteps, StepsError, episode_steps
from cua_rl.logs import get_logger
from cua_rl.rollout.episode import Converted, EpisodeObserver

log = get_logger(__name__)


def converted_steps(
    episode_id: int, rollout_uuid: str, calls: Any, rows: Any, config: StepCreditConfig
) -> EpisodeSteps:
    """The steps of a fresh episode: its ``CapturedCalls`` and ``ConversionResult``."""
    turns = {t.index: (t.step, list(t.actions)) for t in calls.row_turns()}
    return episode_steps(
        episode_id=episode_id,
        rows=rows.rows,
        row_images=rows.row_images,
        row_turns=rows.row_turns,
        turns=turns,
        images=rows.image_data,
        config=config.key,
        rollout_uuid=rollout_uuid,
        row_spans=rows.row_spans,
    )


def stored_steps(
    stored: Any, rows: Sequence[Mapping[str, Any]], config: StepCreditConfig
) -> EpisodeSteps | None:
    """The steps of a stored episode (``StoredEpisode``) and its rebuilt ``rows``; None when it
    does not keep its turns (stored before they were kept, or by another client)."""
    turns = {
        int(t["index"]): (int(t["step"]), list(t.get("actions") or []))
        for t in stored.turns
        if isinstance(t, Mapping) and "index" in t and "step" in t
    }
    trained = [r.turns for r in stored.rows]
    if not turns or any(not t for t in trained):
        return None
    try:
        return episode_steps(
            episode_id=stored.episode_id,
            rows=rows,
            row_images=[r.images for r in stored.rows],
            row_turns=trained,
            turns=turns,
            images=stored.images,
            config=config.key,
            rollout_uuid=stored.rollout_uuid,
            row_spans=[r.spans for r in stored.rows] if all(r.spans for r in stored.rows) else (),
        )
    except StepsError as exc:
        log.warning("stored episode %s: no step credit: %s", stored.rollout_uuid, exc)
        return None


class CreditObserver(EpisodeObserver):
    """Puts each accepted episode's steps in ``ledger`` (train phase; ``observers_of`` adds it
    only when ``step_credit.enabled``); ``stat_scope``: the episode's AReaL stats scope."""

    name = "step_credit"

    def __init__(self, ledger: CreditLedger, config: StepCreditConfig, task: Any, stat_scope: str):
        self.ledger, self.config, self.task = ledger, config, task
        self.stat_scope = stat_scope

    async def converted(self, event: Converted) -> None:
        if not event.rows.ok:
            return
        task = self.task
        try:
            steps = await asyncio.to_thread(
                converted_steps,
                task.episode_id,
                task.rollout_uuid,
                event.calls,
                event.rows,
                self.config,
            )
        except (StepsError, OSError, ValueError) as exc:
            log.warning("episode %s: no step credit: %s", task.rollout_uuid, exc)
            self._record_error(True)
            return
        self._record_error(False)
        self.ledger.put(steps)

    def _record_error(self, failed: bool) -> None:
        """``cua/credit/errors``, per accepted episode (0 or 1): the step's share of episodes
        whose steps could not be read."""
        from areal.utils import stats_tracker

        stats_tracker.get(self.stat_scope).scalar(**{"cua/credit/errors": float(failed)})
