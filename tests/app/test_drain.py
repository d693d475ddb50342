"""The drain: episodes cancelled when a run ends close what they hold, within ``drain.timeout_s``.

Real local servers on loopback (sim gym, local agent, the monitor on a SQLite file) and a model
endpoint that holds every call until released, so the episodes are mid-run, each with a live
gym execution and an agent run waiting on its model, when they are cancelled as AReaL cancels
them at the end of a run. A gym whose terminate hangs shows what a drain cut short names.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
import pytest
from areal.infra import workflow_context
from fastapi import FastAPI

from cua_rl.agent.service_driver import DriverConfig
from cua_rl.clients.genv import GenvTimeouts
from cua_rl.errors import ConfigError
from cua_rl.monitor.protocol import step_client_id
from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.reward import RewardConfig
from cua_rl.rollout.drain import DRAIN_REASON, DrainConfig
from cua_rl.rollout.settings import AgentSection, EndpointSection, GymSection, WorkflowSettings
from cua_rl.rollout.workflow import CUAAgentWorkflow
from cua_rl.serving import ThreadedServer
from cua_rl.sim.agent import AgentServer
from cua_rl.sim.gym import GymServer
from cua_rl.sim.gym_state import Fault
from cua_rl.trajectory.config import TrajectoryConfig
from tests.app.conftest import bare_settings
from tests.conftest import db_rows

RUN = "drain-test"
EPISODES = 3


class HeldModel:
    """An OpenAI-style endpoint that answers no call until ``release`` is set; counts calls."""

    def __init__(self):
        self.release = threading.Event()
        self.calls = 0
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete() -> dict:
            self.calls += 1
            await asyncio.to_thread(self.release.wait)
            return {"choices": []}

        self.server = ThreadedServer(app, name="held-model")


@pytest.fixture
def stack(tmp_path):
    store = MonitorStore(str(tmp_path / "monitor.db"))
    store.ingest(
        {
            "training": {"run_name": RUN, "log_path": "logs", "model_name": "held"},
            "steps": [{"client_id": step_client_id(RUN, 1), "training_client_id": RUN, "step": 1}],
        }
    )
    model = HeldModel()
    with (
        GymServer() as gym,
        AgentServer() as agent,
        ThreadedServer(create_app(store), name="monitor") as monitor,
        model.server,
    ):
        yield gym, agent, monitor, model, tmp_path / "monitor.db"
        model.release.set()
    store.close()


def _workflow(gym, agent, monitor, model, drain_s: float, total_steps: int = 0) -> CUAAgentWorkflow:
    timeouts = GenvTimeouts(connect_s=2, request_s=10, create_s=10, terminate_s=3, backoff_s=0.01)
    return CUAAgentWorkflow(
        WorkflowSettings(
            gym=GymSection(base_url=gym.url, gym_id=gym.gym_id, timeouts=timeouts),
            agent=AgentSection(
                base_url=agent.url, agent="sim", max_steps=3, driver=DriverConfig(deadline_s=300)
            ),
            endpoint=EndpointSection(
                mode="direct", base_url=f"{model.server.url}/v1", model_name="held"
            ),
            trajectory=TrajectoryConfig(),
            reward=RewardConfig(),
            processor_path="unused: no episode gets as far as a row",
            monitor_base_url=monitor.url,
            training_ref=RUN,
            drain=DrainConfig(timeout_s=drain_s),
            total_steps=total_steps,
        )
    )


class _Executor:
    """AReaL's workflow executor as the workflow reads it: never paused; its dispatcher's task
    runner, when the test runs the episodes under one (the drain is installed on it)."""

    def __init__(self, runner=None):
        self.dispatcher = SimpleNamespace(runner=runner)

    def is_paused(self) -> bool:
        return False


class _Engine:
    """The members of AReaL's ``RemoteInfEngine`` the workflow and the gateway read."""

    def __init__(self, runner=None, version: int = 0):
        self.workflow_executor = _Executor(runner)
        self.version = version

    def get_version(self) -> int:
        return self.version

    def choose_server(self) -> str:
        raise AssertionError("direct mode names its server: the engine's is never chosen")


async def _live(gym) -> list[str]:
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.get(f"{gym.base_url}/executions")
        return [e["execution_id"] for e in r.json()["executions"]]


async def _start_episodes(wf, gym, model, versions=(0,) * EPISODES):
    """An episode per policy version in ``versions``, returned once each holds an execution and
    waits on its model call: (their tasks, the executions)."""
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    tasks = [
        asyncio.create_task(
            wf.arun_episode(
                _Engine(version=v), {"task_id": "sim-001-wifi-on", "instruction": "Turn Wi-Fi on."}
            )
        )
        for v in versions
    ]
    while model.calls < len(versions):
        done = [t for t in tasks if t.done()]
        assert not done, [t.result() for t in done]
        await asyncio.sleep(0.05)
    live = await _live(gym)
    assert len(live) == len(versions), live
    return tasks, live


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results


async def _start_and_cancel(stack, drain_s: float, terminate: Fault | None = None):
    """Episodes started, then cancelled as AReaL cancels them (with ``terminate`` as the
    gym's terminate fault meanwhile): the workflow, the executions they held, the drain's
    reports."""
    gym, agent, monitor, model, _ = stack
    wf = _workflow(gym, agent, monitor, model, drain_s)
    tasks, live = await _start_episodes(wf, gym, model)
    drain = wf.runtime.drain
    if terminate is not None:
        gym.gym.config.faults["terminate"] = terminate
    await _cancel_all(tasks)
    return wf, live, drain.reports


@pytest.mark.slow
async def test_cancelled_episodes_close_execution_agent_run_and_records(stack):
    gym, db = stack[0], stack[-1]
    wf, _, reports = await _start_and_cancel(stack, drain_s=20)
    await wf.aclose()
    assert await _live(gym) == []
    assert reports and reports[-1].startswith(f"{EPISODES} episodes cancelled and closed in"), (
        reports
    )
    rollouts = db_rows(db, "SELECT status, status_message FROM rollout")
    assert rollouts == [("cancelled", DRAIN_REASON)] * EPISODES, rollouts
    envs = db_rows(db, "SELECT status, status_message FROM environment")
    assert envs == [("terminated", DRAIN_REASON)] * EPISODES, envs


@pytest.mark.slow
async def test_the_summary_counts_apart_the_prefetched_episodes_the_monitor_does_not_record(stack):
    # A one-step run: policy version 1 is never trained, its episodes (the trainer prefetches a
    # batch after the last step) belong to no step record. Cancelled, the monitor shows only
    # the others: the drain's summary says how many of its count those are.
    gym, agent, monitor, model, db = stack
    wf = _workflow(gym, agent, monitor, model, drain_s=20, total_steps=1)
    tasks, _ = await _start_episodes(wf, gym, model, versions=(0, 0, 1))
    await _cancel_all(tasks)
    await wf.aclose()
    assert await _live(gym) == []
    reports = wf.runtime.drain.reports
    assert reports and reports[-1].startswith("3 episodes cancelled and closed in"), reports
    assert reports[-1].endswith(
        "(1 of them prefetched after the last step, which the monitor does not record)"
    ), reports
    assert (
        db_rows(db, "SELECT status, status_message FROM rollout")
        == [("cancelled", DRAIN_REASON)] * 2
    )


@pytest.mark.slow
async def test_what_the_drain_cannot_close_in_time_is_named(stack):
    gym, db = stack[0], stack[-1]
    # Terminate answers only after a minute: the drain's deadline passes first, by construction.
    wf, live, reports = await _start_and_cancel(stack, drain_s=1, terminate=Fault(latency_s=60))
    overdue = [r for r in reports if r.startswith("left open after")]
    assert len(overdue) == 1, reports
    for execution_id in live:
        assert execution_id in overdue[0], (execution_id, overdue)
    # The episodes keep closing after the deadline: once the gym answers again, nothing is left.
    gym.gym.config.faults.pop("terminate")
    while await _live(gym):
        await asyncio.sleep(0.1)
    await wf.aclose()
    assert db_rows(db, "SELECT DISTINCT status FROM rollout") == [("cancelled",)]


@pytest.mark.parametrize("value", [0, -1, 26, True, "20"])
def test_drain_timeout_must_fit_inside_areals_wait(value):
    with pytest.raises(ConfigError, match="drain.timeout_s"):
        DrainConfig(timeout_s=value)


def test_records_queued_when_the_runner_stops_reach_the_monitor(tmp_path):
    # An episode that ended just before the run's end left its records in the client's queue
    # (sent every 30 s here): the runner's loop, and the client's task, die with its destroy.
    from areal.infra.async_task_runner import AsyncTaskRunner

    from cua_rl.rollout.runtime import RolloutRuntime

    store = MonitorStore(str(tmp_path / "monitor.db"))
    with ThreadedServer(create_app(store), name="monitor") as monitor:
        runner = AsyncTaskRunner(max_queue_size=4)
        runner.initialize()
        settings = bare_settings(
            monitor_base_url=monitor.url, monitor_spool_path=str(tmp_path / "spool.jsonl")
        )
        runtime = RolloutRuntime(settings)
        runtime.monitor_config.flush_interval_s = 30.0
        runtime.bind(_Engine(runner))

        async def episode_that_just_ended():
            client = await runtime.clients.monitor_client()
            client.enqueue(
                "tasks", {"client_id": "t-end", "task_id": "t-end", "name": "n", "description": "d"}
            )
            return client

        runner.submit(episode_that_just_ended, task_id=1)
        client = runner.wait(count=1, timeout=60)[0]
        assert client.pending == 1  # queued, not sent
        runner.destroy()
    rows = store._reader().execute("SELECT task_id FROM task").fetchall()
    store.close()
    assert [tuple(r) for r in rows] == [("t-end",)]


def test_a_runtime_drains_only_its_own_runner():
    # The drain is installed on the engine's runner, not on AReaL's class: another training's
    # runner in the process (another runtime's, or none) stops as AReaL stops it.
    from areal.infra.async_task_runner import AsyncTaskRunner

    from cua_rl.rollout.runtime import RolloutRuntime

    ours, theirs = AsyncTaskRunner(max_queue_size=1), AsyncTaskRunner(max_queue_size=1)
    runtime = RolloutRuntime(bare_settings())
    runtime.bind(_Engine(ours))
    runtime.bind(_Engine(ours))  # idempotent: wrapped once
    assert ours.destroy._cua_drain is runtime.drain
    assert not hasattr(theirs.destroy, "_cua_drain")
    assert not hasattr(AsyncTaskRunner.destroy, "_cua_drain")


def test_a_run_that_ends_with_nothing_in_flight_says_so():
    # The drain runs at every end; with no episode to close, its one line says that it did.
    from areal.infra.async_task_runner import AsyncTaskRunner

    from cua_rl.rollout.drain import NOTHING_IN_FLIGHT
    from cua_rl.rollout.runtime import RolloutRuntime

    runner = AsyncTaskRunner(max_queue_size=1)
    runner.initialize()
    runtime = RolloutRuntime(bare_settings())
    runtime.bind(_Engine(runner))
    runner.destroy()
    assert runtime.drain.reports == [NOTHING_IN_FLIGHT]


@pytest.mark.slow
def test_a_group_is_drained_whole_before_the_runner_stops(stack, monkeypatch):
    # AReaL runs a task's episodes as a group, a gather without return_exceptions: cancelled, it
    # ends with its first cancelled child, and the runner's loop stopped while the siblings were
    # still closing. Here one sibling's terminate waits until the group's task has ended, so a
    # loop that stops with the group leaves that sibling's execution and records open.
    import logging

    from areal.infra.async_task_runner import AsyncTaskRunner
    from areal.infra.remote_inf_engine import GroupedRolloutWorkflow

    from cua_rl.clients.genv import GenvClient

    gym, agent, monitor, model, db = stack
    wf = _workflow(gym, agent, monitor, model, drain_s=20)
    held: list[str] = []
    terminate = GenvClient.terminate

    async def terminate_after_the_group(self, execution_id):
        if not held:
            held.append(execution_id)
            group = next(t for t in asyncio.all_tasks() if t.get_name() == "1")
            await asyncio.wait({group})
        return await terminate(self, execution_id)

    monkeypatch.setattr(GenvClient, "terminate", terminate_after_the_group)

    runner = AsyncTaskRunner(max_queue_size=4)
    runner.initialize()
    engine = _Engine(runner)  # AReaL's engine holds the runner its episodes run on

    async def group():
        workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
        grouped = GroupedRolloutWorkflow(wf, EPISODES, logging.getLogger("test-drain"))
        data = {"task_id": "sim-001-wifi-on", "instruction": "Turn Wi-Fi on."}
        return await grouped.arun_episode(engine, data)

    runner.submit(group, task_id=1)
    for _ in range(600):  # each episode holds an execution and waits on its model call
        if model.calls >= EPISODES:
            break
        threading.Event().wait(0.05)
    assert model.calls == EPISODES
    runner.destroy()
    assert held, "no sibling's terminate was held: the case did not happen"
    live = httpx.get(f"{gym.base_url}/executions", timeout=10).json()["executions"]
    assert live == []
    rollouts = db_rows(db, "SELECT status, status_message FROM rollout")
    assert rollouts == [("cancelled", DRAIN_REASON)] * EPISODES, rollouts
    envs = db_rows(db, "SELECT status, status_message FROM environment")
    assert envs == [("terminated", DRAIN_REASON)] * EPISODES, envs
