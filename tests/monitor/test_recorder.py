"""The rollout recorder and the context: what reaches the store, and that each change goes once.

The monitor here is the hand-written fake of conftest (a real store behind a transport that
records every batch it took), so the test can look at what was sent as well as what was stored.
"""

from __future__ import annotations

import asyncio
import collections
import json

import httpx
import pytest

from cua_rl.monitor.worker.client import MonitorClient, MonitorClientConfig
from cua_rl.monitor.worker.context import MonitorContext, current, monitor_context
from cua_rl.monitor.worker.recorder import RolloutRecorder

from .conftest import FlakyMonitor, uid


@pytest.fixture
def fake(store):
    return FlakyMonitor(store)


@pytest.fixture
async def client(fake, tmp_path):
    cfg = MonitorClientConfig(
        base_url="http://monitor.test",
        flush_interval_s=0.02,
        spool_path=str(tmp_path / "spool.jsonl"),
    )
    c = MonitorClient(cfg, client=httpx.AsyncClient(transport=httpx.MockTransport(fake.handler)))
    await c.start()
    yield c
    await c.close(timeout=2)


async def _training_and_step(client: MonitorClient) -> tuple[str, str]:
    run = client.training(uid("run-"), log_path="runs/x", model_name="tiny", status="running")
    step = client.step(run, 1, status="rollout_running")
    return run, step


def _one(store, sql: str, *params):
    return store._reader().execute(sql, params).fetchone()


async def _record(recorder: RolloutRecorder, turns: int = 2) -> None:
    await recorder.start(group=0, env_index=3)
    await recorder.environment("creating")
    await recorder.environment("running", gbox_id="box-9")
    for n in range(1, turns + 1):
        await recorder.turn_start(n)
        await recorder.turn_end(n, model_response=f"reply {n}", timings={"model_s": 0.5})
        await recorder.action(n, 0, "tap", {"x": n, "y": 2}, tokens=[5, 6], logprobs=[-0.5, -1.0])
        await recorder.observation(n, 0, obs_type="screenshot", screenshot_uri=f"s{n}.png")
    await recorder.environment("terminated")
    await recorder.validation(success=True, actual_result="done", score=0.9)
    await recorder.complete(reward=1.0, task_success=1)


async def test_recorded_rollout_lands_in_the_store(client, fake, store):
    run, step = await _training_and_step(client)
    uuid = uid("rollout-")
    recorder = RolloutRecorder(
        client,
        uuid,
        task_id="task-settings",
        model_path="ckpt/v0",
        source=MonitorContext(training_id=run, step_id=step),
        task={"name": "Open settings", "description": "Open the settings app"},
    )
    await _record(recorder, turns=2)
    assert await client.flush(timeout=10)
    assert client.counters.dropped == 0

    rollout = store.get_rollout(store.find_id("rollout", uuid))
    assert (rollout["source_type"], rollout["status"], rollout["reward"]) == (
        "step",
        "completed",
        1.0,
    )
    assert rollout["step_id"] == store.find_id("step", step)
    assert (rollout["num_turns"], rollout["num_total_actions"], rollout["env_index"]) == (2, 2, 3)
    assert rollout["validation_passed"] == 1 and rollout["task_success"] == 1
    assert [t["turn"] for t in rollout["turns"]] == [1, 2]
    turn = rollout["turns"][1]
    assert turn["model_response"] == "reply 2"
    assert json.loads(turn["metrics_json"]) == {"timings": {"model_s": 0.5}}
    (action,) = turn["actions"]
    assert (action["tool_name"], json.loads(action["tool_args"])) == ("tap", {"x": 2, "y": 2})
    assert json.loads(action["logprobs"]) == [-0.5, -1.0] and action["num_tokens"] == 2
    assert turn["observations"][0]["screenshot_uri"] == "s2.png"
    assert rollout["validation"]["actual_result"] == "done"
    assert rollout["validation"]["extra"] == {"score": 0.9}
    env = rollout["environment"]
    assert (env["status"], env["gbox_id"], env["env_type"]) == ("terminated", "box-9", "android")
    assert env["creation_time"] and env["termination_time"]
    task = _one(store, "SELECT name, description FROM task WHERE task_id = ?", "task-settings")
    assert tuple(task) == ("Open settings", "Open the settings app")

    history = store.status_history("rollout", rollout["id"])
    assert [h["new_status"] for h in history] == ["pending", "env_creation", "running", "completed"]
    env_history = store.status_history("environment", env["id"])
    assert [h["new_status"] for h in env_history] == ["creating", "running", "terminated"]


async def test_each_change_is_sent_once(client, fake, store):
    run, step = await _training_and_step(client)
    uuid = uid("rollout-")
    recorder = RolloutRecorder(
        client, uuid, task_id="t-once", model_path="m", source=MonitorContext(run, step)
    )
    await _record(recorder, turns=3)
    assert await client.flush(timeout=10)
    sent = [
        (key, r) for b in fake.batches for key, rs in b.items() if key != "training" for r in rs
    ]
    rollout_records = [r for key, r in sent if key == "rollouts"]
    # No field is re-sent with the value it already had.
    seen: dict[str, object] = {}
    for record in rollout_records:
        for name, value in record.items():
            if name != "client_id":
                assert seen.get(name, object()) != value, f"{name} re-sent unchanged"
                seen[name] = value
    # No trajectory is re-posted: each turn is sent at its start and its end, nothing more.
    turns = collections.Counter(r["client_id"] for key, r in sent if key == "turns")
    assert set(turns) == {f"{uuid}:turn:{n}" for n in (1, 2, 3)}
    assert set(turns.values()) <= {1, 2}  # start and end, or both merged into one record
    assert sum(1 for key, _ in sent if key == "actions") == 3
    assert all("turns" not in r and "trajectory" not in json.dumps(r) for _, r in sent)


async def test_fail_and_cancel_end_the_rollout_with_a_reason(client, store):
    run, step = await _training_and_step(client)
    failed, cancelled = uid("rollout-"), uid("rollout-")
    ctx = MonitorContext(training_id=run, step_id=step)
    # fail() without start(): the rollout is still created complete, then failed.
    await RolloutRecorder(client, failed, task_id="t", model_path="m", source=ctx).fail(
        "gym_error", error_message="create failed: 500"
    )
    r2 = RolloutRecorder(client, cancelled, task_id="t", model_path="m", source=ctx)
    await r2.start()
    await r2.turn_start(1)
    await r2.fail("cancelled")
    assert await client.flush(timeout=10)
    assert client.counters.dropped == 0
    one = store.get_rollout(store.find_id("rollout", failed))
    assert (one["status"], one["status_message"]) == ("failed", "gym_error")
    assert one["error_message"] == "create failed: 500"
    two = store.get_rollout(store.find_id("rollout", cancelled))
    assert (two["status"], two["num_turns"]) == ("cancelled", 1)


async def test_eval_and_baseline_sources(client, store):
    run = client.training(uid("run-"), log_path="l", model_name="m")
    ev = client.eval(run, 5, model_path="ckpt/5", status="running")
    base = client.baseline(run, model_path="ckpt/0", status="running")
    ids = {}
    for kind, ctx in (
        ("eval", MonitorContext(run, eval_id=ev)),
        ("baseline", MonitorContext(run, baseline_id=base)),
    ):
        ids[kind] = uid(f"{kind}-")
        rec = RolloutRecorder(client, ids[kind], task_id="t", model_path="m", source=ctx)
        await rec.complete(reward=0.0)
    client.baseline(run, client_id=base, status="completed", success_rate=0.5)
    assert await client.flush(timeout=10)
    assert client.counters.dropped == 0
    ev_row = store.get_rollout(store.find_id("rollout", ids["eval"]))
    assert (ev_row["source_type"], ev_row["is_eval"], ev_row["eval_id"]) == (
        "eval",
        1,
        store.find_id("eval", ev),
    )
    b_row = store.get_rollout(store.find_id("rollout", ids["baseline"]))
    assert (b_row["source_type"], b_row["baseline_id"]) == (
        "baseline",
        store.find_id("baseline", base),
    )
    training = store.get_training(store.find_id("training", run))
    assert [(b["status"], b["success_rate"]) for b in training["baselines"]] == [("completed", 0.5)]
    assert [e["step"] for e in training["evals"]] == [5]


async def test_without_client_or_source_nothing_is_recorded(client, fake):
    quiet = RolloutRecorder(None, uid(), task_id="t", model_path="m", source=MonitorContext(1, 2))
    orphan = RolloutRecorder(client, uid(), task_id="t", model_path="m", source=MonitorContext(1))
    for rec in (quiet, orphan):
        assert not rec.enabled
        await _record(rec)
    assert client.pending == 0 and fake.calls == 0


async def test_context_is_inherited_by_tasks_and_scoped():
    assert current() == MonitorContext()
    seen = []

    async def child():
        seen.append(current().source())

    with monitor_context(training_id="run", step_id="step-run-1-0"):
        await asyncio.create_task(child())
        with monitor_context(eval_id=7):
            await asyncio.create_task(child())
            recorder = RolloutRecorder(object(), "u", task_id="t", model_path="m")
            assert recorder.source == ("eval", 7)
        await asyncio.create_task(child())
    assert seen == [("step", "step-run-1-0"), ("eval", 7), ("step", "step-run-1-0")]
    assert current() == MonitorContext()


async def test_recorded_turns_keep_the_agents_step_times(client, store):
    from cua_rl.trajectory import Turn

    run, step = await _training_and_step(client)
    uuid = uid("rollout-")
    recorder = RolloutRecorder(
        client, uuid, task_id="t-times", model_path="m", source=MonitorContext(run, step)
    )

    def turn(n: int, began: float | None, ended: float | None) -> Turn:
        return Turn(n, n - 1, [1], [2], [-0.5], "stop", [], None, f"r{n}", started_at=began,
                    ended_at=ended)  # fmt: skip

    # 1714557600 is 2024-05-01 10:00:00 UTC; turn 2 comes from an agent whose events had no ts.
    await recorder.record_turns([turn(1, 1714557600.25, 1714557603.0), turn(2, None, None)])
    await recorder.complete(reward=0.0)
    assert await client.flush(timeout=10)
    rows = store.get_rollout(store.find_id("rollout", uuid))["turns"]
    assert (rows[0]["start_time"], rows[0]["end_time"]) == (
        "2024-05-01 10:00:00.250000",
        "2024-05-01 10:00:03.000000",
    )
    assert rows[0]["turn_time"] == pytest.approx(2.75)
    assert rows[1]["start_time"] > "2024-05-02"  # recorded now: the recorder's own clock
