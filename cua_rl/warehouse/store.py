"""The warehouse's observer: an accepted train episode stored so its rows rebuild exactly.

``monitor.store_episodes`` says which accepted episodes of the train phase are kept
(``successes``, what replay draws from; ``all``; ``none``). One is stored through the worker's
monitor client as its rows' token data, image hashes and the agent's turns
(``stored_episode_of``), after the monitor's own records of the rollout, which it names
(docs/warehouse.md). An episode the monitor does not record (no monitor, or a rollout the run never
trains) is not stored either.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from cua_rl.rollout.episode import Ended, EpisodeObserver, EpisodeTask
from cua_rl.warehouse.rebuild import stored_episode_of


class WarehouseObserver(EpisodeObserver):
    """See the module docstring. ``monitor``: the episode's monitor client, or None when it is
    not recorded; ``policy``: ``monitor.store_episodes``; ``training``: the run's name."""

    name = "warehouse"

    def __init__(
        self,
        monitor: Callable[[], Awaitable[Any]],
        task: EpisodeTask,
        *,
        policy: str,
        phase: str,
        training: str,
    ):
        self.monitor, self.task = monitor, task
        self.policy, self.phase, self.training = policy, phase, training

    async def ended(self, event: Ended) -> None:
        if not event.accepted or self.phase != "train" or self.policy == "none":
            return
        success = bool(event.reward.success)
        if self.policy == "successes" and not success:
            return
        client = await self.monitor()
        if client is None:
            return
        client.store_episode(
            stored_episode_of(
                event.rows,
                event.calls.turns,
                task_id=self.task.task_id,
                rollout_uuid=self.task.rollout_uuid,
                training=self.training,
                success=success,
            )
        )
