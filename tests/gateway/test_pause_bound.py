"""A weight update that never ends, under AReaL's real engine: the calls waiting in the gateway
fail with the reason at a bound derived from the run's own pauses.

AReaL 1.0.4 gives the rollout side no signal of a failed or hung weight update (see
``cua_rl.gateway.weight_pauses``): what a rollout worker sees is its ``RemoteInfEngine`` paused
and never resumed. So the engine here is AReaL's own, connected to a stand-in model server, paused and
resumed through its public ``pause``/``resume`` exactly as ``PPOTrainer`` does around an update.
Time is the test's: the pause record reads a clock the test advances, so the bound is crossed by
construction, and a read counter shows the gateway checked the pause before the bound too.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from cua_rl.aio import within
from cua_rl.gateway import AReaLEngineView, Gateway, GatewayConfig, Sampling, SessionSpec
from cua_rl.gateway.weight_pauses import PauseBound, WeightPauses
from cua_rl.serving import ThreadedServer
from cua_rl.testing.model_standin import ModelStandIn
from cua_rl.trajectory.config import TrajectoryConfig
from tests.gateway.conftest import user

# Real seconds a test may take: the waits are crossed by the test's clock, never by this.
BOUND_S = 60.0


class ManualClock:
    """Seconds the test sets; counts how often the gateway read it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.reads = 0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.reads += 1
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


@pytest.fixture
def areal_engine():
    """AReaL's ``RemoteInfEngine`` with its ``WorkflowExecutor``, on a stand-in vLLM server."""
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.vllm_remote import VLLMBackend
    from areal.infra.remote_inf_engine import RemoteInfEngine

    standin = ModelStandIn()
    server = ThreadedServer(standin.app, name="model-standin").start()
    config = InferenceEngineConfig(
        experiment_name="pause-bound", trial_name="t", max_concurrent_rollouts=2
    )
    engine = RemoteInfEngine(config, VLLMBackend())
    engine.initialize(addr=f"{server.host}:{server.port}", train_data_parallel_size=1)
    try:
        yield engine, standin
    finally:
        engine.destroy()
        server.stop()


@pytest.fixture
def episode(areal_engine, bpe_processor):
    """episode(**gateway config) -> (gateway, url, pause record, clock) on AReaL's engine."""
    engine, _ = areal_engine
    started: list[Gateway] = []

    def make(**config):
        clock = ManualClock()
        pauses = WeightPauses(clock=clock)
        gw = Gateway(GatewayConfig(**config)).start()
        started.append(gw)
        spec = SessionSpec(
            AReaLEngineView(engine, pauses),
            Sampling(max_new_tokens=8),
            bpe_processor,
            "policy",
            TrajectoryConfig(),
        )
        return gw, gw.open("ep", spec), pauses, clock

    yield make
    for gw in started:
        gw.stop()


def _post(http: httpx.AsyncClient, url: str, text: str) -> asyncio.Task:
    body = {"messages": [user(text)]}
    return asyncio.create_task(http.post(f"{url}/chat/completions", json=body))


async def _found_paused(pauses: WeightPauses, call: asyncio.Task) -> None:
    """Until the call has found the rollout paused (the record's pause started)."""
    while pauses.started is None:
        assert not call.done(), call.result().text
        await asyncio.sleep(0.02)


async def _checked_again(clock: ManualClock) -> None:
    """Until the gateway has read the clock twice more: one whole check of the pause."""
    seen = clock.reads
    while clock.reads < seen + 2:
        await asyncio.sleep(0.02)


async def _fails_past(
    call: asyncio.Task, pauses: WeightPauses, clock: ManualClock, bound_s: float
) -> httpx.Response:
    """Once the call found the pause: the pause at its bound (the call still waits), then past
    it by a second; the call's answer."""
    await within(BOUND_S, _found_paused(pauses, call))
    clock.advance(bound_s)
    await within(BOUND_S, _checked_again(clock))
    assert not call.done(), "a pause inside its bound keeps the call waiting"
    clock.advance(1.0)
    return await within(BOUND_S, call)


def _timed_out(r: httpx.Response) -> str:
    err = r.json()["error"]
    assert r.status_code == 503 and err["code"] == "pause_timeout", r.text
    return err["message"]


async def test_a_pause_that_never_ends_fails_its_calls_at_a_multiple_of_the_run_s_longest(
    areal_engine, episode
):
    engine, standin = areal_engine
    gw, url, pauses, clock = episode(pause_wait_factor=3.0, min_pause_wait_s=5.0)
    async with httpx.AsyncClient(timeout=120) as http:
        # A weight update of 20 s (the trainer's pause and resume), which a call waited out.
        engine.pause()
        first = _post(http, url, "a")
        await within(BOUND_S, _found_paused(pauses, first))
        clock.advance(20.0)
        engine.resume()
        assert (await within(BOUND_S, first)).status_code == 200
        assert pauses.longest_s == 20.0 and pauses.ended == 1

        # The next update never resumes the rollout: its bound is 3 x 20 s.
        engine.pause()
        r = await _fails_past(_post(http, url, "b"), pauses, clock, 60.0)
    assert engine.workflow_executor.is_paused()  # still paused: the bound ended the wait
    message = _timed_out(r)
    assert "paused 61.0 s" in message and "stuck or failed" in message
    assert "pause_wait_factor=3 x the longest pause this run has had (20.0 s)" in message
    assert standin.calls == 1  # only the first call reached the model server
    assert [e.code for e in gw.close("ep").errors] == ["pause_timeout"]


async def test_before_any_pause_has_ended_the_wait_is_bounded_by_max_pause_wait_s(
    areal_engine, episode
):
    engine, standin = areal_engine
    gw, url, pauses, clock = episode(max_pause_wait_s=600.0, min_pause_wait_s=5.0)
    async with httpx.AsyncClient(timeout=120) as http:
        engine.pause()
        r = await _fails_past(_post(http, url, "a"), pauses, clock, 600.0)
    message = _timed_out(r)
    assert "gateway.max_pause_wait_s=600 (no pause of this run has ended yet)" in message
    assert standin.calls == 0
    gw.close("ep")


@pytest.mark.parametrize(
    ("longest", "expected"),
    [
        (None, 3600.0),  # nothing measured: the configured bound
        (10.0, 300.0),  # 4 x 10 s is under the floor
        (100.0, 400.0),  # 4 x the longest
        (2000.0, 3600.0),  # capped by max_pause_wait_s
    ],
)
def test_the_bound_is_the_factor_times_the_longest_pause_within_floor_and_ceiling(
    longest, expected
):
    assert PauseBound(first_s=3600.0, factor=4.0, floor_s=300.0).of(longest)[0] == expected


def test_a_pause_is_measured_from_the_first_call_that_found_it_to_the_first_that_did_not():
    clock = ManualClock()
    pauses = WeightPauses(clock=clock)
    pauses.running()  # no pause in progress: nothing measured
    assert pauses.longest_s is None
    assert pauses.paused_for() == 0.0
    clock.advance(7.0)
    assert pauses.paused_for() == 7.0  # a second call in the same pause
    clock.advance(3.0)
    pauses.running()
    pauses.running()  # a second waiter seeing the same resume
    assert (pauses.longest_s, pauses.ended) == (10.0, 1)
    pauses.paused_for()
    clock.advance(4.0)
    pauses.running()
    assert (pauses.longest_s, pauses.ended) == (10.0, 2)  # the longest, not the last
