"""Two trainings' rollout runtimes in one process share nothing.

A runtime holds what a rollout worker's episodes share (cua_rl/rollout/runtime.py): its gateway,
the model-server calls that gateway holds, the service pauses, the drain, the replay pool and the
group filter's settings. Two of them in one process, built from two trainings' settings (as two
engines get them), are checked side by side: what one holds, pauses, drains or judges never
reaches the other. Real parts: both gateways serve HTTP on loopback, the model server is a
stand-in on loopback, and each drain runs on an AReaL task runner of its own.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from types import SimpleNamespace

import httpx
import pytest
import torch
from areal.infra import workflow_context
from areal.infra.async_task_runner import AsyncTaskRunner
from areal.utils import stats_tracker

from cua_rl.aio import within
from cua_rl.gateway import GatewayConfig, Sampling, SessionSpec
from cua_rl.rollout import groups
from cua_rl.rollout.groups import GroupSettings
from cua_rl.rollout.runtime import RolloutRuntime
from cua_rl.rollout.service_pauses import MODEL_SERVER, PauseConfig
from cua_rl.rollout.settings import AgentSection, GymSection, WorkflowSettings
from cua_rl.serving import ThreadedServer
from cua_rl.testing.model_standin import ModelStandIn
from cua_rl.trajectory.config import TrajectoryConfig
from cua_rl.warehouse.replay import ReplayConfig
from tests.app.conftest import bare_settings
from tests.gateway.conftest import FakeEngine

FAST = PauseConfig(probe_initial_s=0.02, probe_max_s=0.1, probe_timeout_s=20)
BOUND_S = 60.0  # guards against a hang; no assertion depends on it


def _settings(run: str, size: int, model_server_url: str) -> WorkflowSettings:
    """One training's settings: its run name, its group size, its pauses and gateway (services
    named on the discard port: nothing here calls them)."""
    return bare_settings(
        gym=GymSection(base_url="http://127.0.0.1:9", gym_id="sim"),
        agent=AgentSection(base_url="http://127.0.0.1:9"),
        training_ref=run,
        pause=FAST,
        gateway=GatewayConfig(model_server_url=model_server_url),
        group=GroupSettings(size=size, replay=ReplayConfig(enabled=True), training=run),
    )


class _Executor:
    def __init__(self, runner):
        self.dispatcher = SimpleNamespace(runner=runner)

    def is_paused(self) -> bool:
        return False


class _Engine:
    """What the runtime reads of AReaL's engine: the task runner its episodes run on."""

    def __init__(self, runner):
        self.workflow_executor = _Executor(runner)


@pytest.fixture
def model():
    with ThreadedServer(ModelStandIn().app, name="model-standin") as server:
        yield f"http://127.0.0.1:{server.port}"


@pytest.fixture
def runners():
    made = []

    def runner() -> AsyncTaskRunner:
        r = AsyncTaskRunner(max_queue_size=4)
        r.initialize()
        made.append(r)
        return r

    yield runner
    for r in made:
        r.destroy()


def _group(rewards: list[float], episodes: list[int]) -> dict:
    return {"rewards": torch.tensor(rewards), "episode_id": torch.tensor([[e] for e in episodes])}


def test_each_runtime_has_its_own_gateway(model, tiny_vl_model_dir):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vl_model_dir)
    a = RolloutRuntime(_settings("run-a", 2, model))
    b = RolloutRuntime(_settings("run-b", 3, model))
    spec = SessionSpec(FakeEngine("x:1"), Sampling(), processor, "tiny", TrajectoryConfig())
    try:
        a.gateway.open("episode-a", spec)
        assert a.gateway.base_url != b.gateway.base_url
        seen_by = {
            name: httpx.get(f"{rt.gateway.base_url}/episodes/episode-a/v1/models").status_code
            for name, rt in (("a", a), ("b", b))
        }
        assert seen_by == {"a": 200, "b": 404}
        assert (a.gateway.open_episodes, b.gateway.open_episodes) == (1, 0)
    finally:
        asyncio.run(a.aclose())
        asyncio.run(b.aclose())


async def test_calls_one_gateway_holds_pause_only_its_runtime_s_episodes(model):
    a = RolloutRuntime(_settings("run-a", 2, model))
    b = RolloutRuntime(_settings("run-b", 3, model))
    try:
        server = model.removeprefix("http://")
        # A's gateway holds a call its model server refused; B's holds none.
        a.outages.hold(server, "refused", outage_s=600.0)
        waiting = asyncio.create_task(a.admit("train"))  # A's next episode
        assert await within(BOUND_S, b.admit("train")) == 0  # B's starts at once
        for _ in range(1000):  # the pause opens at the episode's start (state, polled)
            if MODEL_SERVER in a.service_pauses().open:
                break
            await asyncio.sleep(0.01)
        assert set(a.service_pauses().open) == {MODEL_SERVER}
        assert not b.service_pauses().open and b.outages.held() == []
        assert not waiting.done()
        a.outages.release(server, answered=True)  # the held call answered: /health next
        assert await within(BOUND_S, waiting) > 0
    finally:
        await a.aclose()
        await b.aclose()


def test_each_runtime_s_filter_judges_with_its_training_s_settings_and_pool():
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    stats_tracker.get("rollout").export(reset=True)
    a = RolloutRuntime(_settings("run-a", 2, ""))
    b = RolloutRuntime(_settings("run-b", 3, ""))
    a.replay.note(1, "task-a", 0, "uuid-1")
    assert a.replay.episode(1) is not None and b.replay.episode(1) is None
    two = _group([1.0, 0.0], [1, 2])

    def judged_in(runtime) -> bool:  # as AReaL calls the filter: in the episodes' context
        def call():
            runtime.enter_group()
            return groups.complete_groups(dict(two))

        return contextvars.copy_context().run(call)

    assert judged_in(a) is True  # A's groups are of two episodes
    assert judged_in(b) is False  # B's are of three: incomplete
    assert a.groups.settings.size == 2 and b.groups.settings.size == 3


def test_one_runtime_s_drain_cancels_only_its_own_episodes(model, runners):
    a = RolloutRuntime(_settings("run-a", 2, model))
    b = RolloutRuntime(_settings("run-b", 3, model))
    runner_a, runner_b = runners(), runners()
    a.bind(_Engine(runner_a))
    b.bind(_Engine(runner_b))
    started = {"a": threading.Event(), "b": threading.Event()}
    finish_b = threading.Event()
    ends: dict[str, str] = {}

    def episode(name: str, runtime: RolloutRuntime):
        async def body():
            started[name].set()
            try:
                while not finish_b.is_set():
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                ends[name] = "cancelled"
                raise
            ends[name] = "finished"
            return name

        async def registered():  # what arun_episode hands AReaL
            return await runtime.drain.registered(body)

        return registered

    runner_a.submit(episode("a", a), task_id=1)
    runner_b.submit(episode("b", b), task_id=1)
    assert started["a"].wait(BOUND_S) and started["b"].wait(BOUND_S)
    runner_a.destroy()  # the run of training A ends
    assert ends == {"a": "cancelled"}  # B's episode goes on
    finish_b.set()
    assert runner_b.wait(count=1, timeout=BOUND_S) == ["b"]
    assert ends == {"a": "cancelled", "b": "finished"}
