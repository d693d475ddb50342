"""CUAAgentWorkflow on the real local stack: sim gym, local agent, vLLM CPU with a tiny Qwen2-VL,
the rollout gateway, and a real monitor on a SQLite file. The engine is a hand-written stand-in
exposing exactly what the workflow and the gateway use of AReaL's engine (``get_version``,
``choose_server``, a workflow executor that is never paused and has no task runner)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from types import SimpleNamespace

import httpx
import pytest
import torch
from areal.infra import workflow_context
from areal.utils import stats_tracker

from cua_rl.agent.loop import LoopConfig
from cua_rl.agent.service_driver import DriverConfig
from cua_rl.clients.genv import GenvClient, GenvTimeouts
from cua_rl.gateway import GatewayConfig, Sampling
from cua_rl.monitor.protocol import step_client_id
from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.monitor.worker.observer import recorder_for
from cua_rl.reward import RewardConfig
from cua_rl.rollout import groups
from cua_rl.rollout.episode import EpisodeTask
from cua_rl.rollout.groups import GroupSettings
from cua_rl.rollout.runtime import EpisodeScope, RolloutRuntime
from cua_rl.rollout.service_pauses import PauseConfig
from cua_rl.rollout.settings import AgentSection, EndpointSection, GymSection, WorkflowSettings
from cua_rl.rollout.workflow import CUAAgentWorkflow
from cua_rl.serving import ThreadedServer, bind_free_port
from cua_rl.sim.agent import AgentServer
from cua_rl.sim.gym import GymServer
from cua_rl.tasks import task_row
from cua_rl.testing.forward import load_vl_model, trained_gap
from cua_rl.trajectory.config import TrajectoryConfig
from tests.app.conftest import bare_settings

pytestmark = pytest.mark.slow

ROW_KEYS = {
    "input_ids",
    "loss_mask",
    "logprobs",
    "versions",
    "attention_mask",
    "rewards",
    "episode_id",
    "mm_token_type_ids",
    "multi_modal_input",
}
RUN = "wf-test"
FAST_GYM = GenvTimeouts(
    connect_s=2, request_s=10, create_s=10, evaluate_s=10, terminate_s=3, backoff_s=0.01
)


class _Running:
    """A workflow executor that is never paused (no weight update in these tests), whose
    dispatcher has no task runner (these tests cancel their episodes themselves)."""

    dispatcher = SimpleNamespace(runner=None)

    def is_paused(self) -> bool:
        return False


class FakeEngine:
    """The members of AReaL's ``RemoteInfEngine`` the workflow and the gateway use; records which
    server each episode got."""

    def __init__(self, addresses: list[str], version: int = 0):
        self.addresses = list(addresses)
        self.version = version
        self.chosen: list[str] = []
        self.workflow_executor = _Running()

    def get_version(self) -> int:
        return self.version

    def choose_server(self) -> str:
        addr = self.addresses[len(self.chosen) % len(self.addresses)]
        self.chosen.append(addr)
        return addr


@pytest.fixture(scope="module")
def gym():
    with GymServer() as server:
        yield server


@pytest.fixture(scope="module")
def agent():
    with AgentServer() as server:
        yield server


def training_batch() -> dict:
    """The training and its first steps: they exist before rollouts are recorded (train.py's
    order)."""
    return {
        "training": {"run_name": RUN, "log_path": "logs", "model_name": "tiny-vl"},
        "steps": [
            {"client_id": step_client_id(RUN, n), "training_client_id": RUN, "step": n}
            for n in range(1, 5)
        ],
    }


@pytest.fixture
def monitor(tmp_path):
    store = MonitorStore(str(tmp_path / "monitor.db"))
    store.ingest(training_batch())
    with ThreadedServer(create_app(store), name="monitor") as server:
        server.db_path = tmp_path / "monitor.db"
        yield server
    store.close()


@pytest.fixture(scope="module")
def easy_task(gym):
    async def first_easy():
        async with GenvClient(gym.url, gym.gym_id) as client:
            from cua_rl.tasks import load_tasks_gym

            tasks = await load_tasks_gym(client)
        return next(t for t in tasks if "easy" in t.tags)

    return task_row(asyncio.run(first_easy()))


def _settings(gym, agent, vllm_server, model_dir, monitor=None, **changes) -> WorkflowSettings:
    settings = WorkflowSettings(
        gym=GymSection(base_url=gym.url, gym_id=gym.gym_id, timeouts=FAST_GYM),
        agent=AgentSection(
            base_url=agent.url,
            agent="sim",
            max_steps=3,
            max_run_time_s=240,
            model_options={"logprobs": True, "parse": "lenient"},
            driver=DriverConfig(deadline_s=300),
        ),
        endpoint=EndpointSection(model_name=vllm_server.model),
        trajectory=TrajectoryConfig(),
        reward=RewardConfig(shaping=[{"name": "parse_error_penalty", "penalty": 0.1}]),
        processor_path=str(model_dir),
        monitor_base_url=monitor.url if monitor else "",
        training_ref=RUN if monitor else "",
        sampling=Sampling(temperature=1.0, max_new_tokens=24),
    )
    for key, value in changes.items():
        setattr(settings, key, value)
    return settings


def _engine(vllm_server, version: int = 0) -> FakeEngine:
    addr = vllm_server.base_url.removesuffix("/v1").removeprefix("http://")
    return FakeEngine([addr], version=version)


async def _open_executions(gym) -> list[dict]:
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.get(f"{gym.url}/api/v1/{gym.gym_id}/executions")
        r.raise_for_status()
        return r.json()["executions"]


async def _set_faults(gym, **faults) -> None:
    """Set the given operations' faults and clear the others (an update would keep them)."""
    body = {op: faults.get(op, {}) for op in ("create", "evaluate", "terminate")}
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.put(f"{gym.url}/api/v1/_sim/faults", json=body)
        r.raise_for_status()


def _rollout_stats() -> dict[str, float]:
    return stats_tracker.get("rollout").export(reset=True)


async def test_episode_produces_an_exact_row_and_monitor_records(
    gym, agent, vllm_server, tiny_vl_model_dir, monitor, easy_task
):
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    _rollout_stats()
    wf = CUAAgentWorkflow(_settings(gym, agent, vllm_server, tiny_vl_model_dir, monitor))
    engine = _engine(vllm_server, version=3)
    try:
        row = await wf.arun_episode(engine, dict(easy_task))
    finally:
        await wf.aclose()
    assert row is not None, _rollout_stats()
    assert set(row) == ROW_KEYS
    L = row["input_ids"].shape[1]
    for key in ("loss_mask", "logprobs", "versions", "attention_mask", "mm_token_type_ids"):
        assert row[key].shape == (1, L), key
    trained = row["loss_mask"][0].bool()
    assert trained.any()
    # Generated tokens carry the engine's version; prompt tokens carry -1 and logprob 0.
    assert (row["versions"][0][trained] == 3).all()
    assert (row["versions"][0][~trained] == -1).all()
    assert (row["logprobs"][0][~trained] == 0).all()
    assert (row["logprobs"][0][trained] <= 0).all()
    mm = row["multi_modal_input"][0]
    n_pads = int(row["mm_token_type_ids"].sum())
    merge = 2 * 2  # Qwen2-VL merges 2x2 patches into one pad token
    assert n_pads == int(mm["image_grid_thw"].prod(dim=1).sum()) // merge
    assert mm["pixel_values"].shape[0] == int(mm["image_grid_thw"].prod(dim=1).sum())
    assert row["rewards"].dtype == torch.float32
    assert engine.chosen, "the episode must use one of the engine's servers"

    # Stats under the rollout scope.
    stats = _rollout_stats()
    assert stats["rollout/cua/accepted"] == 1.0
    assert stats["rollout/cua/gateway/calls"] == stats["rollout/cua/turns"] >= 1
    assert stats["rollout/cua/gateway/errors"] == 0
    assert stats["rollout/cua/trained_tokens"] == float(trained.sum())

    # Monitor: the rollout under step v + 1, its environment, turns, actions with tokens.
    db = sqlite3.connect(monitor.db_path)
    (rid, status, src, step_ref) = db.execute(
        "SELECT r.id, r.status, r.source_type, s.step FROM rollout r JOIN step s ON r.step_id = s.id"
    ).fetchone()
    assert (status, src, step_ref) == ("completed", "step", 4)
    turns = db.execute("SELECT COUNT(*) FROM turn WHERE rollout_id = ?", (rid,)).fetchone()[0]
    assert turns >= 1
    actions = db.execute(
        "SELECT COUNT(*), SUM(num_tokens) FROM action a JOIN turn t ON a.turn_id = t.id "
        "WHERE t.rollout_id = ?",
        (rid,),
    ).fetchone()
    assert actions[0] >= 1 and actions[1] >= 1
    env = db.execute("SELECT status FROM environment WHERE rollout_id = ?", (rid,)).fetchone()
    assert env == ("terminated",)
    assert db.execute("SELECT COUNT(*) FROM validation").fetchone()[0] == 1
    db.close()
    assert await _open_executions(gym) == []


def _builtin(settings: WorkflowSettings) -> WorkflowSettings:
    """The same settings in ``agent.mode: builtin``: no agent service named at all."""
    settings.agent = AgentSection(**{**settings.agent.__dict__, "mode": "builtin", "base_url": ""})
    return settings


# agent.mode=function with the local agent's loop written as an agent function (tests/agent/
# agents.py): async, and sync (run in a thread with a blocking box).
FUNCTION_AGENTS = {
    "function": "tests.agent.agents:loop_agent",
    "function-sync": "tests.agent.agents:loop_agent_sync",
}


def _function(settings: WorkflowSettings, path: str) -> WorkflowSettings:
    """The same settings in ``agent.mode: function`` with the agent function at ``path``."""
    settings.agent = AgentSection(
        **{**settings.agent.__dict__, "mode": "function", "base_url": "", "function": path}
    )
    return settings


FAULTS = [
    ("gym_create", "gym_error"),
    ("gym_evaluate", "gym_error"),
    ("model_down", "gateway_model_server_error"),
    ("model_down_direct", "agent_model_error"),
    ("gateway_unreachable", "gateway_unreachable"),
    # The gateway holds the call through an outage that outlasts the agent's step: the agent's
    # timeout, not an unreachable gateway (whose advice, gateway.bind_host, would mislead).
    ("model_held", "agent_step_timeout"),
]


@pytest.mark.parametrize(
    ("mode", "fault", "reason"),
    [
        *[("service", f, r) for f, r in [*FAULTS, ("agent_down", "agent_create_failed")]],
        # The builtin loop ends with the service's reasons; a run body the loop refuses is
        # the refused create of a service.
        *[("builtin", f, r) for f, r in [*FAULTS, ("bad_run_body", "agent_create_failed")]],
    ],
)
async def test_faults_end_as_none_with_a_reason_and_no_open_execution(
    gym, agent, vllm_server, tiny_vl_model_dir, easy_task, mode, fault, reason
):
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    _rollout_stats()
    dead = bind_free_port()
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    settings = _settings(gym, agent, vllm_server, tiny_vl_model_dir)
    if mode == "builtin":
        _builtin(settings)
    if fault == "agent_down":
        settings.agent = AgentSection(**{**settings.agent.__dict__, "base_url": dead_url})
    if fault == "bad_run_body":
        # What the config check refuses at start, arriving anyway (a subclass's run spec).
        options = {**settings.agent.model_options, "parse": "guess"}
        settings.agent = AgentSection(**{**settings.agent.__dict__, "model_options": options})
    engine = _engine(vllm_server)
    if fault == "model_down":
        engine = FakeEngine([dead_url.removeprefix("http://")])
        settings.gateway = GatewayConfig(model_outage_s=1.0)
    if fault == "model_held":
        # Held until the episode ends: only the agent's step limit can end the call.
        engine = FakeEngine([dead_url.removeprefix("http://")])
        settings.gateway = GatewayConfig(model_outage_s=3600.0)
        settings.agent = AgentSection(**{**settings.agent.__dict__, "max_step_time_s": 1.0})
    if fault == "model_down_direct":
        settings.endpoint = EndpointSection(
            mode="direct", base_url=f"{dead_url}/v1", model_name="tiny-vl"
        )
    if fault == "gateway_unreachable":
        # The agent is told a gateway address where nothing listens (a wrong public_port).
        settings.gateway = GatewayConfig(public_port=dead.getsockname()[1])
    if fault.startswith("gym_"):
        await _set_faults(gym, **{fault.removeprefix("gym_"): {"fail_rate": 1.0}})
    wf = CUAAgentWorkflow(settings)
    try:
        row = await wf.arun_episode(engine, dict(easy_task))
    finally:
        await wf.aclose()
        await _set_faults(gym)
        dead.close()
    assert row is None
    stats = _rollout_stats()
    assert stats.get(f"rollout/cua/rejected/{reason}") == 1.0, stats
    assert stats["rollout/cua/accepted"] == 0.0
    if fault == "model_down":
        # A rejected episode's gateway counters are its step's too: the outage it waited out.
        assert stats["rollout/cua/gateway/outage_s"] >= 1.0, stats
    assert await _open_executions(gym) == []


async def test_a_gym_failing_every_create_holds_new_episodes_until_it_answers(
    gym, agent, vllm_server, tiny_vl_model_dir, monitor, easy_task, tmp_path
):
    """The episode in flight is rejected gym_error; the next one waits at its start (no box, no
    rollout record) while the gym is probed, and runs to a row once the gym answers."""
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    _rollout_stats()
    outcomes = tmp_path / "outcomes"
    settings = _settings(
        gym,
        agent,
        vllm_server,
        tiny_vl_model_dir,
        monitor,
        pause=PauseConfig(probe_initial_s=0.05, probe_max_s=0.2),
        outcome_dir=str(outcomes),
    )
    wf = CUAAgentWorkflow(settings)
    engine = _engine(vllm_server)
    await _set_faults(gym, create={"fail_rate": 1.0})
    try:
        assert await wf.arun_episode(engine, dict(easy_task)) is None
        pause = wf.runtime.service_pauses().open["gym"]
        waiting = asyncio.create_task(wf.arun_episode(engine, dict(easy_task)))
        for _ in range(3000):  # a bound for a hung prober, not its speed
            if pause.probes >= 2:
                break
            await asyncio.sleep(0.02)
        assert pause.probes >= 2 and not waiting.done()
        await wf.runtime.clients.monitor.flush()
        db = sqlite3.connect(monitor.db_path)
        assert db.execute("SELECT COUNT(*) FROM rollout").fetchone() == (1,)  # it has not started
        await _set_faults(gym)
        row = await waiting
    finally:
        await wf.aclose()
        await _set_faults(gym)
    assert row is not None and pause.ended is not None
    stats = _rollout_stats()
    assert stats["rollout/cua/time/pause_wait_s"] > 0, stats
    statuses = db.execute("SELECT status, status_message FROM rollout ORDER BY id").fetchall()
    assert [s for s, _ in statuses] == ["failed", "completed"], statuses
    assert statuses[0][1] == "gym_error", statuses
    (service, probes, end) = db.execute(
        "SELECT service, probes, end_time FROM service_pause"
    ).fetchone()
    db.close()
    assert service == "gym" and probes >= 2 and end is not None
    lines = [json.loads(x) for f in outcomes.iterdir() for x in f.read_text().splitlines()]
    assert [(x["ok"], x.get("probe", False)) for x in lines] == [
        (False, False),
        *[(False, True)] * probes,
        (True, False),
    ]
    assert await _open_executions(gym) == []


@pytest.mark.parametrize("mode", ["service", "builtin", "function"])
async def test_cancelled_episode_leaves_no_open_execution(
    gym, agent, vllm_server, tiny_vl_model_dir, easy_task, mode
):
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    settings = _settings(gym, agent, vllm_server, tiny_vl_model_dir)
    if mode == "builtin":
        _builtin(settings)
    if mode == "function":
        # An agent that never ends by itself: only the cancel (the run's drain) ends it.
        _function(settings, "tests.agent.agents:hanging_agent")
    wf = CUAAgentWorkflow(settings)
    task = asyncio.create_task(wf.arun_episode(_engine(vllm_server), dict(easy_task)))
    # Cancel while the agent is running (the execution exists by then).
    for _ in range(1200):  # up to a minute: a bound for a hung episode, not its speed
        await asyncio.sleep(0.05)
        if await _open_executions(gym):
            break
    assert await _open_executions(gym), "the episode never opened an execution"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wf.aclose()
    assert await _open_executions(gym) == []


def _bare_workflow(**settings) -> CUAAgentWorkflow:
    """A workflow whose services are never called: its settings' defaults plus ``settings``."""
    return CUAAgentWorkflow(bare_settings(**settings))


def _group(rewards: list[float], episodes: list[int]) -> dict:
    return {
        "rewards": torch.tensor(rewards),
        "episode_id": torch.tensor([[e] for e in episodes]),
    }


def test_the_group_filter_judges_with_the_runtime_of_the_episodes_that_ran():
    # AReaL calls the filter with the group alone, in the task that called arun_episode: the
    # runtime the workflow ran its episodes in is the one whose settings judge the group.
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    train = _bare_workflow(phase="train", group=GroupSettings(size=4))
    engine = FakeEngine(["127.0.0.1:1"])
    four = _group([1.0, 0.0, 0.0, 1.0], [1, 2, 3, 4])

    async def call(wf):
        wf.arun_episode(engine, {"task_id": "t"}).close()  # what AReaL does first, not awaited
        return groups.complete_groups(dict(four))

    assert asyncio.run(call(train)) is True
    assert train.runtime.groups.settings.size == 4
    # Another training's workflow, in its own runtime: a group of four is not its size.
    other = _bare_workflow(phase="train", group=GroupSettings(size=2))
    other_engine = FakeEngine(["127.0.0.1:1"])

    async def call_other():
        other.arun_episode(other_engine, {"task_id": "t"}).close()
        return groups.complete_groups(dict(four))

    assert asyncio.run(call_other()) is False
    # Outside any episode's context the filter refuses rather than guesses.
    with pytest.raises(ValueError, match="no runtime"):
        groups.complete_groups(dict(four))


def test_settings_must_be_workflow_settings():
    with pytest.raises(ValueError, match="WorkflowSettings"):
        CUAAgentWorkflow({"gym": {}})


def _unused():
    raise AssertionError("direct mode needs no processor to point the agent at a server")


def test_direct_mode_points_the_agent_at_the_engine_or_an_external_server(
    gym, agent, vllm_server, tiny_vl_model_dir
):
    settings = _settings(gym, agent, vllm_server, tiny_vl_model_dir)
    settings.endpoint = EndpointSection(mode="direct", base_url="http://models.example:8000/v1/")
    engine = _engine(vllm_server)
    endpoint = RolloutRuntime(settings).open_endpoint(
        "u", engine, processor=_unused, model_name="m"
    )
    assert endpoint.url == "http://models.example:8000/v1"
    assert endpoint.close() is None  # nothing captured: the agent calls the server itself
    assert engine.chosen == []
    settings.endpoint = EndpointSection(mode="direct")
    endpoint = RolloutRuntime(settings).open_endpoint(
        "u", engine, processor=_unused, model_name="m"
    )
    assert endpoint.url == vllm_server.base_url


async def test_rollouts_after_the_last_step_are_not_recorded_against_a_step():
    class Loop:
        async def monitor_client(self):
            return "a monitor client"

    async def recorder(phase: str, total_steps: int, version: int):
        settings = _bare_workflow(training_ref=RUN, phase=phase, total_steps=total_steps).settings
        task = EpisodeTask({"task_id": "t"}, "u", version)
        runtime = RolloutRuntime(settings)
        episode = EpisodeScope(
            task, settings, runtime, Loop(), None, False, "rollout", _unused, "m"
        )  # fmt: skip
        return recorder_for(await episode.monitor(), settings, task, is_eval=False)

    # Versions 0 and 1 are trained by steps 1 and 2; version 2 was prefetched and never trained.
    assert [(await recorder("train", 2, v)).enabled for v in (0, 1, 2, 3)] == [
        True,
        True,
        False,
        False,
    ]
    assert (await recorder("train", 2, 1)).source == ("step", step_client_id(RUN, 2))
    assert (await recorder("train", 0, 50)).enabled  # unknown length: everything is recorded
    # The eval after the last step has its own record.
    assert (await recorder("eval", 2, 2)).enabled


async def test_the_workflows_of_an_engine_share_its_runtime_and_clients():
    # AReaL builds a workflow per submitted group: clients per instance leaked a connection pool
    # and a monitor client per episode. The engine's runtime holds them, one per engine.
    def settings(monitor_url: str) -> WorkflowSettings:
        return bare_settings(
            gym=GymSection(base_url="http://127.0.0.1:3", gym_id="sim"),
            agent=AgentSection(base_url="http://127.0.0.1:4"),
            monitor_base_url=monitor_url,
        )

    engine, other_engine = FakeEngine(["127.0.0.1:1"]), FakeEngine(["127.0.0.1:1"])
    a, b = (
        CUAAgentWorkflow(settings("http://127.0.0.1:1")),
        CUAAgentWorkflow(settings("http://127.0.0.1:1")),
    )
    other = CUAAgentWorkflow(settings("http://127.0.0.1:1"))
    assert a.runtime_for(engine) is b.runtime_for(engine)
    assert other.runtime_for(other_engine) is not a.runtime
    http = a.runtime.clients.http()
    assert b.runtime.clients.http() is http
    assert other.runtime.clients.http() is not http
    # The builtin mode's agent loop too: one pool and vocabulary cache per runtime and loop.
    loop = a.runtime.clients.agent_loop(LoopConfig())
    assert b.runtime.clients.agent_loop(LoopConfig()) is loop
    assert a.runtime.clients.agent_loop(LoopConfig(step_latency_s=1.0)) is not loop
    loop_http = loop.client
    await a.aclose()
    assert http.is_closed and loop_http.is_closed
    fresh = b.runtime.clients.http()  # a closed runtime makes fresh clients when used again
    assert fresh is not http and not fresh.is_closed
    await b.aclose()
    await other.aclose()
    # A workflow with other services on the same engine is refused, not given another's.
    with pytest.raises(ValueError, match="one engine"):
        CUAAgentWorkflow(settings("http://127.0.0.1:2")).runtime_for(engine)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_agent_without_token_data_trains_through_the_gateway(
    gym, agent, vllm_bpe_server, tiny_vl_bpe_model_dir, easy_task, temperature
):
    """The local agent asks for no logprobs and no token ids (an unpatched agent): the row comes
    from the gateway's capture, and a transformers forward pass reproduces every trained token's
    logprob at the trainer's temperature, whatever the agent asked (here temperature 0)."""
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    _rollout_stats()
    settings = _settings(gym, agent, vllm_bpe_server, tiny_vl_bpe_model_dir)
    settings.agent = AgentSection(
        **{**settings.agent.__dict__, "model_options": {"logprobs": False, "parse": "lenient"}}
    )
    settings.sampling = Sampling(temperature=temperature, max_new_tokens=24)
    wf = CUAAgentWorkflow(settings)
    # The agent asks for temperature 0; the trainer's temperature wins and the ask is recorded.
    wf.build_run_spec = _asking_temperature_zero(wf.build_run_spec)
    try:
        row = await wf.arun_episode(_engine(vllm_bpe_server, version=2), dict(easy_task))
    finally:
        await wf.aclose()
    stats = _rollout_stats()
    assert row is not None, stats
    assert stats["rollout/cua/gateway/overridden_calls"] == stats["rollout/cua/gateway/calls"] >= 1
    trained = row["loss_mask"][0].bool()
    assert (row["versions"][0][trained] == 2).all()
    model = load_vl_model(tiny_vl_bpe_model_dir)
    gap = trained_gap(model, row, temperature=temperature)
    assert gap.max().item() < 1e-3, gap.max().item()


def _asking_temperature_zero(build):
    def build_run_spec(task, box, model_base_url):
        spec = build(task, box, model_base_url)
        spec.model_options = {**spec.model_options, "temperature": 0.0}
        return spec

    return build_run_spec


class _KeepsConversions(CUAAgentWorkflow):
    """The workflow as it runs, keeping each episode's conversion for the checks."""

    def __init__(self, settings):
        super().__init__(settings)
        self.results = []

    async def build_rows(self, task, calls, reward):
        result = await super().build_rows(task, calls, reward)
        self.results.append((calls.capture, result))
        return result


async def test_bpe_episodes_sampled_freely_keep_every_turn_in_one_exact_row(
    gym, agent, vllm_bpe_server, tiny_vl_bpe_model_dir, easy_task
):
    """Tokens in, tokens out: the BPE model sampled without any constraint at temperature 1.0,
    8 episodes of 4 turns through the gateway. The agent resends its history as text; the
    gateway extends the ids it served, so no prefix breaks: every turn trains in one row, and
    the transformers forward pass reproduces every trained token's logprob."""
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    _rollout_stats()
    settings = _settings(gym, agent, vllm_bpe_server, tiny_vl_bpe_model_dir)
    settings.agent = AgentSection(
        **{
            **settings.agent.__dict__,
            "max_steps": 4,
            "model_options": {"logprobs": False, "parse": "lenient"},
        }
    )
    settings.sampling = Sampling(temperature=1.0, max_new_tokens=24)
    wf = _KeepsConversions(settings)
    try:
        rows = await asyncio.gather(
            *(wf.arun_episode(_engine(vllm_bpe_server), dict(easy_task)) for _ in range(8))
        )
    finally:
        await wf.aclose()
    assert all(row is not None for row in rows), _rollout_stats()
    assert len(wf.results) == 8
    model = load_vl_model(tiny_vl_bpe_model_dir)
    for capture, result in wf.results:
        stats = result.stats
        assert stats["turns"] >= 4, stats
        assert stats["prefix_breaks"] == 0 and stats["trained_turns"] == stats["turns"], stats
        assert capture.stats()["gateway/new_segments"] == 0
        # The agent got text back and sent text: the row's ids are the ones sampled.
        assert sum(len(t.output_ids) for t in capture.turns) == stats["trained_tokens"]
        gap = trained_gap(model, result.row)
        assert gap.max().item() < 1e-3, gap.max().item()
    # Unconstrained BPE sampling did produce what re-tokenising would change (docs/design.md, vLLM): the
    # check above is not vacuous.
    tok = wf.processor.tokenizer
    changed = sum(
        tok.encode(tok.decode(t.output_ids, skip_special_tokens=True), add_special_tokens=False)
        != [i for i in t.output_ids if i not in tok.all_special_ids]
        for capture, _ in wf.results
        for t in capture.turns
    )
    assert changed > 0


def _monitor_episode(db_path, rollout_id: int) -> dict:
    """What the monitor recorded of one rollout that names no execution: its actions (with
    their sampled tokens), its observations' kinds, the validation's verdict, the outcome."""
    db = sqlite3.connect(db_path)
    try:
        q = lambda sql: db.execute(sql, (rollout_id,)).fetchall()  # noqa: E731
        return {
            "actions": q(
                "SELECT t.turn, a.action_type, a.tool_name, a.tool_args, a.tokens, "
                "a.num_tokens FROM action a JOIN turn t ON a.turn_id = t.id "
                "WHERE t.rollout_id = ? ORDER BY t.turn, a.id"
            ),
            "turns": q(
                "SELECT turn, model_response, json_extract(metrics_json, '$.trained') "
                "FROM turn WHERE rollout_id = ? ORDER BY turn"
            ),
            "obs": q(
                "SELECT t.turn, o.obs_type, o.screenshot_uri FROM obs o "
                "JOIN turn t ON o.turn_id = t.id WHERE t.rollout_id = ? ORDER BY t.turn, o.id"
            ),
            "validation": q("SELECT success FROM validation WHERE rollout_id = ?"),
            "rollout": q("SELECT status, reward, task_success FROM rollout WHERE id = ?"),
        }
    finally:
        db.close()


async def test_builtin_and_function_modes_act_record_and_train_as_the_agent_service(
    gym, agent, vllm_server, tiny_vl_model_dir, monitor, easy_task
):
    """One task under one gym seed, greedy sampling (the same model answers): the episode the
    workflow runs itself (builtin), the one an agent function written with the openai SDK runs
    (function: async, and sync in a thread) and the one the local agent service runs execute the
    same actions on the box, record the same turns, actions and screenshots in the monitor, and
    give the same row."""
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    rows, episodes = {}, {}
    modes = ("service", "builtin", *FUNCTION_AGENTS)
    for mode in modes:
        _rollout_stats()
        settings = _settings(gym, agent, vllm_server, tiny_vl_model_dir, monitor)
        settings.sampling = Sampling(greedy=True, max_new_tokens=24)
        if mode == "builtin":
            _builtin(settings)
        if mode in FUNCTION_AGENTS:
            _function(settings, FUNCTION_AGENTS[mode])
        runs_before = len(agent.service.runs)
        wf = CUAAgentWorkflow(settings)
        try:
            rows[mode] = await wf.arun_episode(_engine(vllm_server), dict(easy_task))
        finally:
            await wf.aclose()
        assert rows[mode] is not None, (mode, _rollout_stats())
        # Only the service's episode asked the agent service for a run.
        assert len(agent.service.runs) == runs_before + (mode == "service")
        db = sqlite3.connect(monitor.db_path)
        (rid,) = db.execute("SELECT MAX(id) FROM rollout").fetchone()
        db.close()
        episodes[mode] = _monitor_episode(monitor.db_path, rid)

    service = episodes["service"]
    assert service["actions"] and service["turns"] and service["obs"], service
    assert all(trained == 1 for _, _, trained in service["turns"]), service["turns"]
    assert all(uri for *_, uri in service["obs"]), service["obs"]
    for mode in modes[1:]:
        other = episodes[mode]
        assert [a[:4] for a in other["actions"]] == [a[:4] for a in service["actions"]], mode
        assert other["actions"] == service["actions"], mode
        assert other["turns"] == service["turns"], mode
        assert other["obs"] == service["obs"], mode
        assert other["validation"] == service["validation"] and service["validation"], mode
        assert other["rollout"] == service["rollout"], mode
        assert service["rollout"] == [("completed",) + service["rollout"][0][1:]]
        a, b = rows["service"], rows[mode]
        assert set(a) == set(b) == ROW_KEYS
        for key in ("input_ids", "loss_mask", "versions", "attention_mask", "mm_token_type_ids"):
            assert torch.equal(a[key], b[key]), (mode, key)
        assert torch.allclose(a["logprobs"], b["logprobs"], atol=1e-4), mode
        assert torch.equal(a["rewards"], b["rewards"]), mode
        for k in ("pixel_values", "image_grid_thw"):
            assert torch.equal(a["multi_modal_input"][0][k], b["multi_modal_input"][0][k]), k
    assert await _open_executions(gym) == []
