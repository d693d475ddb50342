"""The rollout worker's step data of its episodes, from their end to their group's filter.

AReaL calls the group filter with the group's rows alone; the steps' state keys, actions and
token spans are known where each episode ended (``cua_rl.credit.observer``), in the same
worker. The ledger keeps them by episode id until the filter takes them (``take``), at most
``max_episodes`` (the oldest go first: an episode whose group was rejected is never taken).
Replayed successes carry their own steps (``cua_rl.warehouse.replay.Recorded.steps``), so a
replay needs no entry here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from cua_rl.credit.steps import EpisodeSteps


class CreditLedger:
    def __init__(self, max_episodes: int = 4096):
        self.max_episodes = max_episodes
        self._items: OrderedDict[int, EpisodeSteps] = OrderedDict()
        self._lock = threading.Lock()
        self.dropped = 0  # entries pushed out unused

    def put(self, steps: EpisodeSteps) -> None:
        with self._lock:
            self._items[steps.episode_id] = steps
            self._items.move_to_end(steps.episode_id)
            while len(self._items) > self.max_episodes:
                self._items.popitem(last=False)
                self.dropped += 1

    def peek(self, episode_id: int) -> EpisodeSteps | None:
        with self._lock:
            return self._items.get(episode_id)

    def take(self, episode_id: int) -> EpisodeSteps | None:
        with self._lock:
            return self._items.pop(episode_id, None)

    def __len__(self) -> int:
        return len(self._items)
