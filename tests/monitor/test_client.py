"""The training-side client: faults injected through a hand-written fake monitor (a real store
behind an ``httpx.MockTransport`` that can fail), contracts against the real server process."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cua_rl.errors import ConfigError
from cua_rl.monitor.protocol import BATCH_KEY_HEADER
from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.worker.client import MonitorClient, MonitorClientConfig, spooled
from cua_rl.monitor.worker.context import MonitorContext
from cua_rl.monitor.worker.recorder import RolloutRecorder
from cua_rl.serving import ThreadedServer

from .conftest import FlakyMonitor, full_batch, uid


def _task(task_id: str) -> dict:
    return {"client_id": task_id, "task_id": task_id, "name": "n", "description": "d"}


@pytest.fixture
def fake(store):
    return FlakyMonitor(store)


def make_client(fake: FlakyMonitor, tmp_path, **overrides) -> MonitorClient:
    settings = dict(
        base_url="http://monitor.test",
        token="t",
        flush_interval_s=0.02,
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
        replay_interval_s=0.05,
        max_retries=2,
        spool_path=str(tmp_path / "spool.jsonl"),
    )
    cfg = MonitorClientConfig(**{**settings, **overrides})
    http = httpx.AsyncClient(transport=httpx.MockTransport(fake.handler))
    return MonitorClient(cfg, client=http)


def task_count(store) -> int:
    return store._reader().execute("SELECT count(*) FROM task").fetchone()[0]


async def test_retries_then_sends(fake, tmp_path, store):
    fake.fail_next = [503, 500]
    async with make_client(fake, tmp_path) as client:
        for i in range(5):
            assert client.enqueue("tasks", _task(f"t{i}"))
        assert await client.flush(timeout=10)
        assert (client.counters.retried, client.counters.sent, client.counters.spooled) == (2, 5, 0)
    assert task_count(store) == 5


async def test_what_is_queued_when_the_run_ends_reaches_the_monitor(fake, tmp_path, store):
    """A run's last records (its training's final status among them) are queued just before
    the client closes, with no flush between: close sends every one."""
    client = make_client(fake, tmp_path, flush_interval_s=10)
    await client.start()
    for i in range(5):
        assert client.enqueue("tasks", _task(f"e{i}"))
    await client.close()
    assert (client.counters.sent, client.counters.spooled, client.counters.dropped) == (5, 0, 0)
    assert task_count(store) == 5


async def test_spools_while_down_then_replays_in_order(fake, tmp_path, store):
    fake.down = True
    client = make_client(fake, tmp_path)
    await client.start()
    client.enqueue("tasks", _task("t-a"))
    assert not await client.flush(timeout=0.5)  # down: it cannot be sent
    # Spooled after its retries and backoff, at the machine's speed: wait for it (bounded).
    await _spooled(client, 1)
    assert client.counters.spooled == 1
    spool = tmp_path / "spool.jsonl"
    assert spool.exists() and len(spool.read_text().splitlines()) == 1
    # While the spool is not empty new batches queue behind it, even a dependent one.
    client.enqueue("validators", {"task_client_id": "t-a", "validator_type": "state"})
    # The worker spools it in the background: wait for that (bounded), not a fixed delay.
    for _ in range(1200):  # up to a minute: a bound for a hung worker, not its speed
        if client.counters.spooled == 2:
            break
        await asyncio.sleep(0.05)
    assert client.counters.spooled == 2 and task_count(store) == 0
    fake.down = False
    assert await client.flush(timeout=10)
    assert client.counters.replayed == 2 and client.counters.dropped == 0
    assert not spool.exists()
    assert task_count(store) == 1
    assert store._reader().execute("SELECT count(*) FROM validator").fetchone()[0] == 1
    await client.close()


async def _spooled(client: MonitorClient, n: int) -> None:
    """Waits (bounded) until ``client`` has spooled ``n`` records: the worker does it in the
    background, after its retries, at whatever speed the machine has."""
    for _ in range(1200):  # up to a minute: a bound for a hung worker, not its speed
        if client.counters.spooled >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"spooled {client.counters.spooled} of {n} records")


async def test_clients_on_one_spool_path_each_write_their_own_file(fake, tmp_path, store):
    # Two clients configured with one path (a config's spool_path shared by the trainer and its
    # rollout workers): each claims its own file, both replay, nothing is lost.
    fake.down = True
    a, b = make_client(fake, tmp_path), make_client(fake, tmp_path)
    for client in (a, b):
        await client.start()
    for i in range(3):
        a.enqueue("tasks", _task(f"a{i}"))
        b.enqueue("tasks", _task(f"b{i}"))
        # Each batch is spooled before the next is queued: the spools interleave batch by batch.
        for client in (a, b):
            await _spooled(client, i + 1)
    assert (a.counters.spooled, b.counters.spooled) == (3, 3)
    files = sorted(p.name for p in tmp_path.glob("spool*.jsonl"))
    assert files == ["spool.1.jsonl", "spool.jsonl"]
    fake.down = False
    for client in (a, b):
        assert await client.flush(timeout=10)
        await client.close()
    assert (a.counters.replayed, b.counters.replayed, task_count(store)) == (3, 3, 6)
    assert list(tmp_path.glob("spool*")) == []  # files and their locks gone once replayed


async def test_a_new_client_replays_what_a_dead_one_left(fake, tmp_path, store):
    fake.down = True
    first = make_client(fake, tmp_path)
    await first.start()
    first.enqueue("tasks", _task("left"))
    await _spooled(first, 1)
    # Held while it runs: a second client spools beside it, never into its file.
    other = make_client(fake, tmp_path)
    await other.start()
    other.enqueue("tasks", _task("beside"))
    await _spooled(other, 1)
    assert (tmp_path / "spool.1.jsonl").exists()
    await other.close(timeout=0.2)
    await first.close(timeout=0.2)  # down: its batch stays in the spool, the claim is given up
    assert len((tmp_path / "spool.jsonl").read_text().splitlines()) == 1
    fake.down = False
    async with make_client(fake, tmp_path) as second:
        assert await second.flush(timeout=10)
        assert second.counters.replayed == 1  # the first's file: the lowest free name
    assert task_count(store) == 1 and not (tmp_path / "spool.jsonl").exists()
    # The other's file goes to the next client that starts on the path.
    async with make_client(fake, tmp_path) as third:
        assert await third.flush(timeout=10)
        assert third.counters.replayed == 1
    assert task_count(store) == 2 and list(tmp_path.glob("spool*")) == []


async def test_a_rollout_sent_before_its_step_waits_for_it_instead_of_being_dropped(
    fake, tmp_path, store
):
    # The rollout worker's record names the trainer's step, which another process sends (after
    # a monitor restart, whichever spool replays first wins): the record must wait, not drop.
    batch = full_batch()
    run, step, rollout = batch["training"], batch["steps"][0], batch["rollouts"][0]
    tasks = {"tasks": batch["tasks"]}
    worker = make_client(fake, tmp_path, spool_path=str(tmp_path / "worker.jsonl"))
    trainer = make_client(fake, tmp_path, spool_path=str(tmp_path / "trainer.jsonl"))
    async with worker, trainer:
        worker.enqueue("tasks", tasks["tasks"][0])
        worker.enqueue("rollouts", rollout)
        # Refused for the missing step: spooled, nothing dropped, replayed until the step lands.
        for _ in range(1200):  # up to a minute: a bound for a hung worker, not its speed
            if worker.counters.waited:
                break
            await asyncio.sleep(0.05)
        assert worker.counters.waited >= 1 and worker.counters.dropped == 0
        trainer.enqueue("training", run)
        trainer.enqueue("steps", step)
        assert await trainer.flush(timeout=10)
        assert await worker.flush(timeout=10)
    assert worker.counters.dropped == 0
    row = (
        store._reader()
        .execute(
            "SELECT s.step FROM rollout r JOIN step s ON s.id = r.step_id WHERE r.rollout_id = ?",
            (rollout["rollout_id"],),
        )
        .fetchone()
    )
    assert row is not None and tuple(row) == (step["step"],)


async def test_a_missing_step_is_waited_for_a_bounded_time(fake, tmp_path, store):
    batch = full_batch()
    async with make_client(fake, tmp_path, reference_wait_s=0.2) as worker:
        worker.enqueue("tasks", batch["tasks"][0])
        worker.enqueue("rollouts", batch["rollouts"][0])
        assert await worker.flush(timeout=10)  # the wait ends: refused as any other record
        assert worker.counters.waited >= 1 and worker.counters.dropped == 1


async def test_refused_record_is_dropped_alone(fake, tmp_path, store):
    async with make_client(fake, tmp_path, flush_interval_s=0.3) as client:
        client.enqueue("tasks", _task("good-1"))
        client.enqueue("tasks", {"task_id": "bad", "name": "n"})  # description missing
        client.enqueue("tasks", _task("good-2"))
        assert await client.flush(timeout=10)
        assert client.counters.dropped == 1 and client.counters.sent == 2
        assert "description" in client.counters.last_error
    assert task_count(store) == 2


async def test_oversized_batches_are_split(fake, tmp_path, store):
    fake.max_records = 3
    async with make_client(fake, tmp_path, flush_interval_s=0.3) as client:
        for i in range(10):
            client.enqueue("tasks", _task(f"s{i}"))
        assert await client.flush(timeout=10)
        assert client.counters.sent == 10 and client.counters.dropped == 0
    assert task_count(store) == 10


async def test_never_raises_never_blocks_and_close_spools_leftovers(fake, tmp_path, store):
    fake.hang = True
    client = make_client(fake, tmp_path, request_timeout_s=30)
    await client.start()
    assert client.enqueue("nonsense", {}) is False
    assert client.enqueue("tasks", "not a dict") is False
    assert client.counters.dropped == 2
    for i in range(50):
        assert client.enqueue("tasks", _task(f"h{i}"))
    await asyncio.sleep(0.1)  # the worker is now stuck in a hanging POST
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await client.close(timeout=0.3)
    # Well under the hanging POST's 30 s timeout: close did not wait for it (the slack is for a
    # busy machine, not a speed the test needs).
    assert loop.time() - t0 < 15
    # The batch in flight and whatever was queued are in the spool, not lost.
    lines = (tmp_path / "spool.jsonl").read_text().splitlines()
    batches = [spooled(json.loads(line)) for line in lines]
    assert all(key for _, key in batches)  # each kept with its idempotency key
    tasks = [t["task_id"] for batch, _ in batches for t in batch.get("tasks", [])]
    assert sorted(tasks) == sorted(f"h{i}" for i in range(50))

    # A new client on the same spool replays it once the monitor answers.
    fake.hang = False
    async with make_client(fake, tmp_path) as again:
        assert await again.flush(timeout=10)
        assert again.counters.replayed == 50
    assert task_count(store) == 50


async def test_queue_limit_drops_and_counts(fake, tmp_path):
    fake.down = True
    client = make_client(fake, tmp_path, max_queue_records=3, flush_interval_s=10)
    assert [client.enqueue("tasks", _task(f"q{i}")) for i in range(5)] == [True] * 3 + [False] * 2
    assert client.counters.dropped == 2


def test_config_validates_with_fix_hints(monkeypatch):
    monkeypatch.delenv("MONITOR_BASE_URL", raising=False)
    monkeypatch.delenv("MONITOR_PROJECT_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="MONITOR_BASE_URL"):
        MonitorClientConfig(base_url="")
    with pytest.raises(ConfigError, match="batch_max_records"):
        MonitorClientConfig(base_url="http://x", batch_max_records=0)
    monkeypatch.setenv("MONITOR_BASE_URL", "http://127.0.0.1:1/")
    monkeypatch.setenv("MONITOR_PROJECT_TOKEN", "tok")
    cfg = MonitorClientConfig.from_env()
    assert (cfg.base_url, cfg.token) == ("http://127.0.0.1:1", "tok")
    assert MonitorClientConfig().token == "tok"  # not configured: read from the environment
    assert MonitorClientConfig(base_url="http://h:2", token="mine").token == "mine"


async def test_real_server_round_trip(monitor_process, tmp_path):
    cfg = MonitorClientConfig(
        base_url=monitor_process.base_url,
        token=monitor_process.token,
        flush_interval_s=0.05,
        spool_path=str(tmp_path / "s.jsonl"),
    )
    run = uid("run-")
    async with MonitorClient(cfg) as client:
        client.enqueue("training", {"run_name": run, "log_path": "l", "model_name": "m"})
        client.enqueue("tasks", _task("rt-1"))
        assert await client.flush(timeout=20)
        assert client.counters.sent == 2
    bad = MonitorClientConfig(
        base_url=monitor_process.base_url,
        token="wrong",
        flush_interval_s=0.05,
        spool_path=str(tmp_path / "b.jsonl"),
    )
    client = MonitorClient(bad)
    await client.start()
    client.enqueue("tasks", _task("rt-2"))
    assert not await client.flush(timeout=1)
    # A wrong token is kept in the spool rather than lost (spooled in the background: waited for).
    await _spooled(client, 1)
    assert client.counters.spooled == 1 and "401" in client.counters.last_error
    await client.close(timeout=0.5)
    assert (tmp_path / "b.jsonl").exists()


async def test_answer_lost_after_commit_is_not_duplicated(fake, tmp_path, store):
    # The server committed but the client never heard back: it retries, and the retry must not
    # create a second copy of anything (actions included, which carry no natural key).
    fake.lose_answers = 2
    async with make_client(fake, tmp_path, flush_interval_s=0.2) as client:
        client.enqueue("tasks", _task("lost-1"))
        for i in range(3):
            client.enqueue("validators", {"task_client_id": "lost-1", "validator_type": f"v{i}"})
        assert await client.flush(timeout=10)
        assert client.counters.retried == 2 and client.counters.dropped == 0
    assert len(fake.batches) == 3  # the same batch was ingested three times
    assert task_count(store) == 1
    assert store._reader().execute("SELECT count(*) FROM validator").fetchone()[0] == 3


class AnswersLost(httpx.AsyncBaseTransport):
    """Real HTTP to the monitor on loopback; the first ``n`` answers to ingest batches are lost
    after the monitor committed them (the connection drops before the client reads them)."""

    def __init__(self, n: int):
        self.inner = httpx.AsyncHTTPTransport()
        self.n = n
        self.keys: list[str | None] = []  # each ingest POST's idempotency key

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path == "/api/ingest/batch":
            self.keys.append(request.headers.get(BATCH_KEY_HEADER))
            if self.n:
                self.n -= 1
                await response.aclose()
                raise httpx.ReadError("connection reset after commit", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_batch_whose_answer_was_lost_walks_no_record_through_its_statuses_twice(
    tmp_path, store
):
    # One batch holds a rollout's whole life (pending, env_creation, running, completed: status
    # changes are never merged, each is a status_history row). Its answer is lost twice after
    # the monitor committed it; the client sends it again each time. Applied again, it would
    # walk the finished rollout back to pending and through its statuses a second and third time.
    lost = AnswersLost(2)
    with ThreadedServer(create_app(store), name="monitor") as server:
        cfg = MonitorClientConfig(
            base_url=server.url,
            flush_interval_s=10,  # one batch: the flush below sends everything queued at once
            backoff_initial_s=0.01,
            backoff_max_s=0.05,
            max_retries=3,
            spool_path=str(tmp_path / "spool.jsonl"),
        )
        async with MonitorClient(cfg, client=httpx.AsyncClient(transport=lost)) as client:
            run = client.training(uid("run-"), log_path="runs/x", model_name="tiny")
            step = client.step(run, 1, status="rollout_running")
            rollout = uid("rollout-")
            recorder = RolloutRecorder(
                client,
                rollout,
                task_id="task-1",
                model_path="m",
                source=MonitorContext(training_id=run, step_id=step),
            )
            await recorder.start(group=0, env_index=0)
            await recorder.environment("creating")
            await recorder.environment("running", gbox_id="box-1")
            await recorder.environment("terminated")
            await recorder.complete(reward=1.0)
            assert await client.flush(timeout=30)
            assert (client.counters.retried, client.counters.dropped) == (2, 0), client.counters
    assert len(lost.keys) == 3 and lost.keys[0] and len(set(lost.keys)) == 1, lost.keys
    history = store._reader().execute(
        "SELECT h.new_status FROM status_history h JOIN rollout r ON h.entity_id = r.id "
        "WHERE h.entity_type = 'rollout' AND r.rollout_id = ? ORDER BY h.id",
        (rollout,),
    )
    assert [r[0] for r in history] == ["pending", "env_creation", "running", "completed"]


async def test_updates_of_one_record_in_one_batch_are_merged(fake, tmp_path, store):
    client = make_client(fake, tmp_path)
    client.enqueue("tasks", _task("m-1"))
    client.enqueue("tasks", {"client_id": "m-1", "difficulty": "easy"})
    client.enqueue("tasks", _task("m-2"))
    client.enqueue("tasks", {"client_id": "m-1", "category": "settings"})
    await client.start()  # everything above goes in the first batch
    assert await client.flush(timeout=10)
    await client.close()
    (batch,) = fake.batches
    assert [t["client_id"] for t in batch["tasks"]] == ["m-1", "m-2"]
    row = (
        store._reader()
        .execute("SELECT difficulty, category, name FROM task WHERE task_id = 'm-1'")
        .fetchone()
    )
    assert tuple(row) == ("easy", "settings", "n")
