"""A failing service pauses new episodes (cua_rl/rollout/service_pauses.py), against real servers on
loopback: the sim gym with its create fault, the local agent and a model stand-in behind the fault
proxy, a real monitor on a SQLite file, and the failfast watch over real outcome files. Each
outage starts and ends when the test switches it, and the test waits for the probes the pause
reports, never for time to pass."""

from __future__ import annotations

import asyncio
import sqlite3

import httpx
import pytest

from cua_rl.aio import within
from cua_rl.app.failfast import ADVICE, FailFastConfig, RejectionWatch, advice_for
from cua_rl.clients.gbox_mini_agent import MiniAgentClient
from cua_rl.clients.genv import GenvClient, GenvTimeouts
from cua_rl.core.reasons import Reason
from cua_rl.errors import ConfigError, GymError, RejectedEpisode
from cua_rl.gateway import Gateway, GatewayConfig, Sampling, SessionSpec
from cua_rl.gateway.model_outages import Outages
from cua_rl.monitor.worker.client import MonitorClient, MonitorClientConfig
from cua_rl.rollout.outcomes import OutcomeLog
from cua_rl.rollout.service_pauses import (
    AGENT,
    GYM,
    MODEL_SERVER,
    Outage,
    PauseConfig,
    PauseRecords,
    ServicePauses,
    outage_of,
    probe_for,
)
from cua_rl.serving import ThreadedServer
from cua_rl.sim.agent import AgentServer
from cua_rl.sim.gym import GymServer
from cua_rl.testing.fault_proxy import FaultProxy
from cua_rl.testing.model_standin import ModelStandIn
from cua_rl.trajectory.config import TrajectoryConfig
from tests.gateway.conftest import FakeEngine, user

RUN = "pause-test"
FAST = PauseConfig(probe_initial_s=0.02, probe_max_s=0.1, probe_timeout_s=20)
GYM_TIMEOUTS = GenvTimeouts(connect_s=2, request_s=5, create_s=5, terminate_s=3, backoff_s=0.01)
BOUND_S = 60.0  # guards a test against a hang; no assertion depends on it


class Told(PauseRecords):
    """The real records, also handing each failed probe and the end to the test."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failed: asyncio.Queue[int] = asyncio.Queue()
        self.ended = asyncio.Event()

    def probe_failed(self, p) -> None:
        super().probe_failed(p)
        self.failed.put_nowait(p.probes)

    def closed(self, p) -> None:
        super().closed(p)
        self.ended.set()


@pytest.fixture
def gym():
    with GymServer() as server:
        yield server


async def _faults(gym, **faults) -> None:
    body = {op: faults.get(op, {}) for op in ("create", "evaluate", "terminate")}
    async with httpx.AsyncClient(timeout=10) as http:
        (await http.put(f"{gym.url}/api/v1/_sim/faults", json=body)).raise_for_status()


async def _open_executions(gym) -> list[dict]:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(f"{gym.base_url}/executions")).json()["executions"]


async def _rejected_create(genv: GenvClient, task_id: str) -> RejectedEpisode:
    """What the workflow makes of an episode whose create failed."""
    try:
        async with genv.execution(task_id):
            pass
    except GymError as exc:
        try:
            raise RejectedEpisode(Reason.GYM_ERROR, str(exc)) from exc
        except RejectedEpisode as rejected:
            return rejected
    raise AssertionError("the create succeeded")


async def _first_task(genv: GenvClient) -> str:
    return str((await genv.list_tasks())[0]["task_id"])


def _gym_error(status: int | None) -> RejectedEpisode:
    try:
        raise RejectedEpisode(Reason.GYM_ERROR, "x") from GymError("create", status=status)
    except RejectedEpisode as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "created", "agent_unavailable", "service"),
    [
        (_gym_error(500), False, False, GYM),
        (_gym_error(None), False, False, GYM),  # refused, dropped, timed out
        (_gym_error(400), False, False, None),  # the gym refused this task: the episode's
        (_gym_error(503), True, False, None),  # evaluate or terminate: the execution's
        (RejectedEpisode("agent_create_failed", "x"), True, True, AGENT),
        (RejectedEpisode("agent_create_failed", "x"), True, False, None),  # a 4xx
        (RejectedEpisode("gateway_model_server_error", "x"), True, False, MODEL_SERVER),
        (RejectedEpisode(Reason.MISSING_TOKENS, "x"), True, False, None),
        (RejectedEpisode("agent_timeout", "x"), True, False, None),
    ],
)
def test_only_a_service_s_failure_is_an_outage(exc, created, agent_unavailable, service):
    outage = outage_of(exc, created=created, agent_unavailable=agent_unavailable)
    assert (outage.service if outage else None) == service


def test_probe_bounds_are_checked():
    with pytest.raises(ConfigError, match="probe_initial_s <= probe_max_s"):
        PauseConfig(probe_initial_s=5, probe_max_s=1)


async def test_a_gym_failing_every_create_pauses_new_episodes_until_it_answers(gym, monitor):
    await _faults(gym, create={"fail_rate": 1.0})
    client = MonitorClient(MonitorClientConfig(base_url=monitor.url))
    await client.start()
    client.training(RUN, log_path="logs", model_name="tiny")
    told = Told(RUN, monitor=lambda: client)
    pauses = ServicePauses(FAST, told)
    async with GenvClient(gym.url, gym.gym_id, timeouts=GYM_TIMEOUTS) as genv:
        task_id = await _first_task(genv)
        rejected = await _rejected_create(genv, task_id)  # the episode in flight
        outage = outage_of(rejected, created=False)
        assert outage is not None and outage.service == GYM and "500" in outage.error
        probe = probe_for(
            GYM, FAST, genv=genv, agent=None, http=None, task_id=task_id, model_server="",
            outages=Outages(),
        )  # fmt: skip
        pause = pauses.report(outage, probe, phase="train")
        assert pauses.report(outage, probe, phase="train") is None  # one pause per service
        waiting = asyncio.create_task(pauses.admit())  # the next episode
        for _ in range(3):
            await within(BOUND_S, told.failed.get())
        assert not waiting.done() and pause.ended is None
        await client.flush()
        await _faults(gym)
        waited = await within(BOUND_S, waiting)
        assert waited > 0 and told.ended.is_set() and not pauses.open
        assert await pauses.admit() == 0  # no pause: an episode starts at once
    await client.close()
    # The probe that succeeded created an execution and terminated it.
    assert await _open_executions(gym) == []
    db = sqlite3.connect(monitor.db_path)
    rows = db.execute(
        "SELECT service, reason, error_message, probes, start_time, end_time, duration_s "
        "FROM service_pause"
    ).fetchall()
    db.close()
    assert len(rows) == 1, rows
    service, reason, error, probes, start, end, duration = rows[0]
    assert (service, reason) == ("gym", "gym_error")
    assert "500" in error and probes >= 3
    assert end is not None and end > start and duration > 0


async def test_failed_probes_keep_failfast_running_until_it_stops_with_today_s_advice(
    gym, tmp_path
):
    """A gym that fails every create forever: no episode starts, yet failfast stops the run
    once the rejections and the failed probes after them span persist_s."""
    await _faults(gym, create={"fail_rate": 1.0})
    outcomes = OutcomeLog(tmp_path)
    config = FailFastConfig(window=4, persist_s=0.3)
    watch = RejectionWatch(tmp_path, config, on_trip=lambda *_: None)
    told = Told(RUN, outcome=outcomes.record)
    pauses = ServicePauses(FAST, told)
    async with GenvClient(gym.url, gym.gym_id, timeouts=GYM_TIMEOUTS) as genv:
        task_id = await _first_task(genv)
        rejected = await _rejected_create(genv, task_id)
        outcomes.record(accepted=False, reason=rejected.reason, phase="train")
        probe = probe_for(
            GYM, FAST, genv=genv, agent=None, http=None, task_id=task_id, model_server="",
            outages=Outages(),
        )  # fmt: skip
        pauses.report(outage_of(rejected, created=False), probe, phase="train")
        waiting = asyncio.create_task(pauses.admit())
        tripped = None
        # At most one probe per 0.1 s: 100 probes span far more than persist_s.
        for _ in range(100):
            await within(BOUND_S, told.failed.get())
            tripped = watch.poll()
            streak = watch.streak
            long_enough = streak.last_t - streak.first_t >= config.persist_s
            # It stops at the first poll past the configured time, not before, not later.
            assert (tripped is not None) == (long_enough and streak.count >= config.window)
            if tripped:
                break
        assert not waiting.done()
        await pauses.aclose()
        waiting.cancel()
    assert tripped == "gym_error"
    assert advice_for(tripped) == ADVICE[Reason.GYM_ERROR]
    assert await _open_executions(gym) == []


async def _service_behind_proxy(service: str, stack):
    """(probe, proxy) for the agent service or the model server behind a fault proxy."""
    if service == AGENT:
        server = stack.enter_context(AgentServer())
    else:
        standin = ModelStandIn()
        server = stack.enter_context(ThreadedServer(standin.app, name="model"))
    proxy = FaultProxy().start()
    stack.callback(proxy.stop)
    proxy.upstream = ("127.0.0.1", server.port)
    http = httpx.AsyncClient(timeout=10)
    stack.push_async_callback(http.aclose)
    agent = MiniAgentClient(proxy.url, client=http)
    server_addr = proxy.url.removeprefix("http://")
    probe = probe_for(
        service, FAST, genv=None, agent=agent, http=http, task_id="", model_server=server_addr,
        outages=Outages(),
    )  # fmt: skip
    return probe, proxy


@pytest.mark.parametrize(
    ("service", "reason"),
    [(AGENT, "agent_create_failed"), (MODEL_SERVER, "gateway_model_server_error")],
)
async def test_an_agent_or_model_server_outage_pauses_until_it_is_restored(service, reason):
    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        probe, proxy = await _service_behind_proxy(service, stack)
        await probe()  # it serves
        proxy.outage()  # every answer cut from here on
        told = Told(RUN)
        pauses = ServicePauses(FAST, told)
        pauses.report(Outage(service, reason, "cut"), probe, phase="train")
        waiting = asyncio.create_task(pauses.admit())
        for _ in range(2):
            await within(BOUND_S, told.failed.get())
        assert not waiting.done() and service in pauses.open
        proxy.restore()
        assert await within(BOUND_S, waiting) > 0
        assert not pauses.open and proxy.dropped >= 2


async def test_the_run_s_end_stops_the_loop_s_probes():
    from cua_rl.rollout.runtime import RolloutRuntime
    from tests.app.conftest import bare_settings

    async def never_up():
        raise GymError("create answered 503", status=503)

    runtime = RolloutRuntime(bare_settings(pause=FAST))
    pauses = runtime.service_pauses()
    assert runtime.service_pauses() is pauses  # one per loop
    told = Told(RUN)
    pauses.records = told
    pauses.report(Outage(GYM, "gym_error", "503"), never_up, phase="train")
    await within(BOUND_S, told.failed.get())
    (prober,) = pauses._probers
    assert await runtime.flush(1.0)  # what the drain does before the runner stops
    assert prober.done()
    assert runtime.service_pauses() is not pauses  # a later run starts with none open


async def test_a_model_server_out_under_the_gateway_s_held_calls_pauses_new_episodes(
    monitor, tiny_vl_bpe_model_dir
):
    """Every answer cut by the proxy: the gateway holds an episode's call and re-sends it, and the
    next episode's start opens the model server's pause before any episode failed. New episodes
    wait until the held call is answered and the server answers /health; the monitor holds the
    pause. Before the outage, nothing is held and nothing pauses."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vl_bpe_model_dir)
    standin = ModelStandIn()
    server = ThreadedServer(standin.app, name="model-standin").start()
    proxy = FaultProxy().start()
    proxy.set_upstream(server.host, server.port)
    outages = Outages()  # the runtime's, shared with its gateway
    gw = Gateway(
        GatewayConfig(model_server_url=proxy.url, model_outage_s=600.0), outages=outages
    ).start()
    spec = SessionSpec(
        FakeEngine("127.0.0.1:1"), Sampling(max_new_tokens=8), processor, "p", TrajectoryConfig()
    )
    url = gw.open("ep", spec)
    client = MonitorClient(MonitorClientConfig(base_url=monitor.url))
    await client.start()
    client.training(RUN, log_path="logs", model_name="tiny")
    told = Told(RUN, monitor=lambda: client)
    pauses = ServicePauses(FAST, told)
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            ask = {"messages": [user("a")]}
            assert (await http.post(f"{url}/chat/completions", json=ask)).status_code == 200
            pauses.pause_for_held_calls(outages, http, phase="train")
            assert not pauses.open and outages.held() == []  # the server answers: no pause
            proxy.outage()
            call = asyncio.create_task(
                http.post(f"{url}/chat/completions", json={"messages": [user("b")]})
            )
            # The gateway has cut its first answer and holds the call (state, polled).
            for _ in range(1200):
                if outages.held() or call.done():
                    break
                await asyncio.sleep(0.05)
            (held,) = outages.held()
            assert not call.done() and held.calls == 1 and proxy.dropped >= 1
            pauses.pause_for_held_calls(outages, http, phase="train")  # the next episode's start
            assert set(pauses.open) == {MODEL_SERVER}
            waiting = asyncio.create_task(pauses.admit())
            for _ in range(2):
                await within(BOUND_S, told.failed.get())
            assert not waiting.done() and not call.done()
            proxy.restore()
            answered = await within(BOUND_S, call)
            assert answered.status_code == 200
            assert await within(BOUND_S, waiting) > 0
            assert not pauses.open and outages.held() == []
        capture = gw.close("ep")
        assert capture.errors == [] and capture.turns[-1].retries == proxy.dropped
        await client.flush()
    finally:
        await pauses.aclose()
        await client.close()
        gw.stop()
        proxy.stop()
        server.stop()
    db = sqlite3.connect(monitor.db_path)
    rows = db.execute(
        "SELECT service, reason, error_message, probes, end_time FROM service_pause"
    ).fetchall()
    db.close()
    ((service, reason, error, probes, end),) = rows
    assert (service, reason) == (MODEL_SERVER, "gateway_model_server_error")
    assert "the gateway holds 1 model call(s)" in error and probes >= 2 and end is not None
