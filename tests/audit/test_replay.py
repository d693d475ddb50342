"""Replays of the warehouse's recorded successes, read from a real monitor, through a real gym.

A stored episode keeps, per turn, the agent's actions as gbox-mini-agent's events hold them
(``point``, ``content``, ...); the audit turns them back into the gym's actions, replays them on
fresh boxes and removes each state-changing one in turn. The monitor serves them as replay does
(``MonitorClient.successes``); the stored episodes here are written as the workflow stores one.
"""

from __future__ import annotations

import pytest

from cua_rl.audit import plans as P
from cua_rl.audit.config import AuditConfig
from cua_rl.audit.session import Audit
from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.monitor.worker.client import MonitorClient, MonitorClientConfig
from cua_rl.serving import ThreadedServer
from cua_rl.tasks import load_tasks_gym
from cua_rl.warehouse.episode import StoredEpisode, StoredRow
from tests.warehouse.conftest import rollout_batch

RUN = "trained-run"


def _tap(x: int, y: int) -> dict:
    return {"name": "tap", "args": {"point": {"x": x, "y": y}}, "rawResult": {"ok": True}}


def _episode(uuid: str, task: str, steps: list[list[dict]]) -> StoredEpisode:
    """A stored success whose turn ``i`` (step ``i + 1``) ran ``steps[i]``."""
    row = StoredRow([5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.25], [-1, 0, 0], turns=(0,))
    return StoredEpisode(
        task_id=task,
        episode_id=1,
        rollout_uuid=uuid,
        training=RUN,
        reward=1.0,
        success=True,
        version_min=0,
        version_max=0,
        rows=[row],
        turns=[
            {"index": i, "step": i + 1, "text": "...", "actions": actions}
            for i, actions in enumerate(steps)
        ],
    )


@pytest.fixture
async def monitor(tmp_path):
    store = MonitorStore(tmp_path / "monitor.db")
    with ThreadedServer(create_app(store), name="monitor") as server:
        client = MonitorClient(
            MonitorClientConfig(base_url=server.url, spool_path=str(tmp_path / "spool.jsonl"))
        )
        await client.start()
        yield client
        await client.close()
    store.close()


async def _record(client: MonitorClient, episode: StoredEpisode) -> None:
    for kind, records in rollout_batch(episode.rollout_uuid, episode.task_id, run=RUN).items():
        for record in [records] if kind == "training" else records:
            client.enqueue(kind, record)
    assert client.store_episode(episode)
    assert await client.flush(30)


async def test_a_recorded_success_is_replayed_and_each_of_its_changes_removed(gym, genv, monitor):
    good = [
        [_tap(70, 130)],  # Settings
        [_tap(180, 420)],  # nothing there
        [_tap(300, 116), {"name": "finished", "args": {"content": "done"}}],  # Wi-Fi on
    ]
    await _record(monitor, _episode("rollout-good", "user-clean-wifi", good))
    await _record(
        monitor, _episode("rollout-wrong", "user-wrong-field", [[_tap(70, 130)], [_tap(300, 116)]])
    )
    tasks = {t.id: t for t in await load_tasks_gym(genv)}
    audit = Audit(
        AuditConfig(agents=["replay"]),
        genv,
        4,
        successes=lambda task_id: monitor.successes(task_id, [RUN], -1, 1),
    )
    results = {
        r.task.id: r for r in await audit.run([tasks["user-clean-wifi"], tasks["user-wrong-field"]])
    }

    clean = results["user-clean-wifi"]
    recorded = next(p for p in clean.plans if p.key == f"{RUN}/rollout-good")
    assert recorded.steps == (
        {"name": "tap", "args": {"x": 70, "y": 130}},
        {"name": "tap", "args": {"x": 180, "y": 420}},
        {"name": "tap", "args": {"x": 300, "y": 116}},
    )
    assert recorded.answer == "done"
    runs = [r for r in clean.runs if r.plan == recorded.name]
    assert [r.rewarded for r in runs] == [True] * 3
    assert runs[0].effects == ["changed", "unchanged", "changed"]
    # The tap on nothing changed nothing: only steps 0 and 2 are removed, and each matters.
    ablated = [p for p in clean.plans if p.agent == "ablation" and p.replay_key == recorded.key]
    removed = sorted(p.removed for p in ablated)
    assert removed == [0, 2]
    assert clean.verdict.verdict == "clean"

    wrong = results["user-wrong-field"]
    kinds = {(f.kind, f.evidence["plan"]) for f in wrong.verdict.flags}
    assert ("rejects_success", f"replay:{RUN}/rollout-wrong") in kinds


async def test_a_recorded_success_with_a_step_missing_is_not_replayed(gym, genv, monitor):
    gap = _episode("rollout-gap", "user-clean-note", [[_tap(180, 130)], [_tap(305, 50)]])
    gap.turns[1]["step"] = 3  # step 2's turn was never stored
    await _record(monitor, gap)
    tasks = {t.id: t for t in await load_tasks_gym(genv)}
    audit = Audit(
        AuditConfig(agents=["stop", "replay"]),
        genv,
        2,
        successes=lambda task_id: monitor.successes(task_id, [RUN], -1, 1),
    )
    (result,) = await audit.run([tasks["user-clean-note"]])
    # The task's own solution still replays; the broken recording is named, not played.
    assert [p.key for p in result.plans if p.agent == "replay"] == ["solution"]
    assert result.notes == [
        "recorded success rollout-gap: the stored episode lacks steps between 1 and 3"
    ]
    with pytest.raises(P.ReplayError, match="lacks steps between 1 and 3"):
        P.from_stored(gap.turns, training=RUN, rollout="rollout-gap")


def test_event_actions_map_back_to_the_gyms():
    events = [
        {"name": "swipe", "args": {"startPoint": {"x": 1, "y": 2}, "endPoint": {"x": 3, "y": 4}}},
        {"name": "type", "args": {"content": "hi"}},
        {"name": "key", "args": {"key": "enter"}},
        {"name": "wait", "args": {"durationMs": 1500}},
        {"name": "invalid", "args": {"text": "??", "error": "no call"}},
        {"name": "back", "args": {}},
        {"name": "finished", "args": {"content": "42"}},
        {"name": "tap", "args": {"point": {"x": 9, "y": 9}}},  # after the end: not played
    ]
    plan = P.from_stored([{"step": 1, "actions": events}], training="t", rollout="r")
    assert plan.steps == (
        {"name": "swipe", "args": {"x1": 1, "y1": 2, "x2": 3, "y2": 4}},
        {"name": "type", "args": {"text": "hi"}},
        {"name": "key", "args": {"key": "enter"}},
        {"name": "wait", "args": {"seconds": 1.5}},
        {"name": "back", "args": {}},
    )
    assert plan.answer == "42"
    with pytest.raises(P.ReplayError, match="action 'tap'"):
        P.from_stored(
            [{"step": 1, "actions": [{"name": "tap", "args": {}}]}], training="t", rollout="r"
        )
