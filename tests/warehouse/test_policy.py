"""Which accepted episodes the warehouse's observer stores (``monitor.store_episodes``), and what
it hands the monitor client: the converter's rows, their images and the agent's turns."""

from __future__ import annotations

import pytest

from cua_rl.reward import RewardOutcome
from cua_rl.rollout.episode import CapturedCalls, Ended, EpisodeTask
from cua_rl.warehouse import rebuild_rows
from cua_rl.warehouse.store import WarehouseObserver
from tests.app.test_workflow import RUN, _bare_workflow

from .conftest import TASK, assert_rows_equal, converted


class StoringClient:
    """The member of ``MonitorClient`` the warehouse's observer uses; keeps what it is given."""

    def __init__(self):
        self.stored: list = []

    def store_episode(self, episode) -> bool:
        self.stored.append(episode)
        return True


async def _store(images, processor, *, policy: str, phase: str, success: bool):
    turns, result = converted(images, processor, break_prefix=True)
    settings = _bare_workflow(training_ref=RUN, phase=phase, store_episodes=policy).settings
    task = EpisodeTask({"task_id": TASK}, "u-1", 3)
    reward = RewardOutcome(float(success), float(success), success, None)
    client = StoringClient()

    async def monitor():
        return client

    ended = Ended(task, "accepted", calls=CapturedCalls(turns), reward=reward, rows=result)
    observer = WarehouseObserver(
        monitor, task, policy=policy, phase=phase, training=settings.training_ref
    )
    await observer.on(ended)
    return client.stored, result


@pytest.mark.parametrize(
    ("policy", "phase", "success", "stored"),
    [
        ("successes", "train", True, True),
        ("successes", "train", False, False),
        ("all", "train", False, True),
        ("none", "train", True, False),
        ("all", "eval", True, False),  # evaluation episodes train nothing
    ],
)
async def test_the_policy_decides_which_episodes_are_stored(
    images, processor, policy, phase, success, stored
):
    got, _ = await _store(images, processor, policy=policy, phase=phase, success=success)
    assert bool(got) == stored


async def test_the_stored_episode_is_the_trained_rows(images, processor):
    (ep,), result = await _store(images, processor, policy="all", phase="train", success=True)
    assert (ep.task_id, ep.rollout_uuid, ep.training, ep.success) == (TASK, "u-1", RUN, True)
    assert [r.turns for r in ep.rows] == [(0,), (1,)]
    assert [t["step"] for t in ep.turns] == [1, 2]
    assert_rows_equal(rebuild_rows(ep, processor), result.rows)
