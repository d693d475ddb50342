"""The episode's observers kept out of its way (cua_rl/rollout/observers.py), without services:
each observer is told each event in turn, what one raises is counted and logged once per
observer and event kind, and the others are still told."""

from __future__ import annotations

import asyncio
import logging

from areal.utils import stats_tracker

from cua_rl.rollout import observers
from cua_rl.rollout.episode import BoxChanged, Ended, EpisodeObserver, EpisodeTask, Started
from cua_rl.rollout.observers import Observers
from cua_rl.rollout.runtime import RolloutRuntime
from tests.app.conftest import bare_settings
from tests.app.workflows import Raising

TASK = EpisodeTask({"task_id": "t"}, "u", 0)
EVENTS = [Started(TASK), BoxChanged("creating"), BoxChanged("terminated"), Ended(TASK, "failed")]


class Seen(EpisodeObserver):
    """Keeps what it is told, through its typed methods."""

    def __init__(self):
        self.seen: list[str] = []

    async def started(self, event):
        self.seen.append("started")

    async def box_changed(self, event):
        self.seen.append(f"box {event.state}")

    async def ended(self, event):
        self.seen.append(f"ended {event.outcome}")


class Quiet(EpisodeObserver):
    """Overrides nothing: every event is a no-op."""


class Cancels(EpisodeObserver):
    async def started(self, event):
        raise asyncio.CancelledError


def test_a_raising_observer_is_counted_logged_once_per_kind_and_the_others_are_told():
    stats_tracker.get("test-observers").export(reset=True)
    runtime = RolloutRuntime(bare_settings())
    seen, raising = Seen(), Raising()
    handler = _Records()
    logger = observers.log  # the module's own: AReaL replaces logging's manager (cua_rl/logs.py)
    logger.addHandler(handler)
    try:
        for _ in range(2):  # two episodes of one runtime
            emit = Observers(
                [raising, Quiet(), seen], stat_scope="test-observers", first_time=runtime.first_time
            )
            for event in EVENTS:
                asyncio.run(emit(event))
    finally:
        logger.removeHandler(handler)
    assert seen.seen == ["started", "box creating", "box terminated", "ended failed"] * 2
    assert raising.kinds == [e.kind for e in EVENTS] * 2
    stats = stats_tracker.get("test-observers").export(reset=True)
    assert stats["test-observers/cua/observer_errors/raising__count"] == 2 * len(EVENTS), stats
    assert [r.getMessage().split(" raised at ")[1].split()[0] for r in handler.records] == [
        "started",
        "box_changed",
        "ended",
    ]


def test_cancellation_is_not_kept_from_the_episode():
    emit = Observers([Cancels()], stat_scope="test-observers", first_time=lambda key: True)
    try:
        asyncio.run(emit(Started(TASK)))
    except asyncio.CancelledError:
        return
    raise AssertionError("an observer's cancellation was swallowed")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)
