"""Under injected faults no execution stays open, and every failure is a clear GymError.

Faults come from the sim gym itself (``PUT /_sim/faults``: 500s, latency, dropped connections)
or from a hand-written transport that fails chosen calls before they reach the real server.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace

import httpx
import pytest

from cua_rl.clients.genv import GenvClient
from cua_rl.errors import GymError
from cua_rl.sim.gym import SimGymConfig

from .conftest import FAST, open_executions, set_faults

TASK = "sim-001-wifi-on"


async def counters(http, gym) -> dict:
    return (await http.get(f"{gym.url}/healthz")).json()["counters"]


async def test_create_500_is_not_retried_and_leaves_nothing(genv, gym, http):
    await set_faults(http, gym, create={"fail_rate": 1.0})
    with pytest.raises(GymError, match="injected create failure") as ei:
        async with genv.execution(TASK):
            pytest.fail("the body must not run without an execution")
    assert ei.value.status == 500
    c = await counters(http, gym)
    assert c["faults"] == 1 and c["created"] == 0  # exactly one attempt
    assert await open_executions(http, gym) == []


async def test_create_answering_late_is_terminated_by_the_client(gym, http):
    # The server takes 5 s to create; the caller gives up at 0.2 s. The client keeps
    # listening (grace) and terminates what the server reveals; the idle expiry (900 s
    # here) plays no part.
    await set_faults(http, gym, create={"latency_s": 5.0})
    timeouts = replace(FAST, create_s=0.2, create_grace_s=15)
    client = GenvClient(gym.url, gym.gym_id, timeouts=timeouts)
    with pytest.raises(GymError, match="timed out after 0.2s; not retried"):
        async with client.execution(TASK):
            pytest.fail("unreachable")
    # The caller was not held for the late answer: the gym has not created it yet.
    assert (await counters(http, gym))["created"] == 0
    await client.aclose()
    assert client.stats["late_creates_terminated"] == 1
    c = await counters(http, gym)
    assert c["created"] == 1 and c["terminated"] == 1
    assert await open_executions(http, gym) == []


async def test_cancelled_while_creating_still_terminates_the_late_execution(gym, http):
    await set_faults(http, gym, create={"latency_s": 2.0})
    client = GenvClient(gym.url, gym.gym_id, timeouts=FAST)

    async def episode():
        async with client.execution(TASK):
            await asyncio.sleep(30)

    task = asyncio.create_task(episode())
    # Cancel while the create is provably inside the gym (held by its latency), at any speed.
    deadline = time.monotonic() + 60  # a bound for a hung gym, not its speed
    while not (await http.get(f"{gym.url}/healthz")).json()["delaying"].get("create"):
        assert time.monotonic() < deadline, "the create never reached the gym"
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await client.aclose()
    assert (await counters(http, gym))["created"] == 1
    assert await open_executions(http, gym) == []


@pytest.mark.parametrize("gym_config", [SimGymConfig(idle_ttl_s=0.5)])
async def test_dropped_create_is_an_error_and_only_idle_expiry_can_reclaim_it(genv, gym, http):
    await set_faults(http, gym, create={"drop_rate": 1.0})
    with pytest.raises(GymError, match="transport") as ei:
        await genv.create_execution(TASK)
    assert ei.value.status is None
    assert (await counters(http, gym))["created"] == 1  # no blind retry made a second one
    deadline = time.monotonic() + 60  # a bound for a reaper that never runs, not its speed
    while await open_executions(http, gym) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert await open_executions(http, gym) == []


async def test_evaluate_500_propagates_and_the_scope_still_terminates(genv, gym, http):
    await set_faults(http, gym, evaluate={"fail_rate": 1.0})
    with pytest.raises(GymError, match="evaluate") as ei:
        async with genv.execution(TASK) as ex:
            await ex.evaluate()
    assert ei.value.status == 500
    assert genv.stats["evaluate_retries"] == FAST.evaluate_attempts - 1
    assert await open_executions(http, gym) == []


async def test_evaluate_timeout_is_a_gym_error_and_terminates(gym, http):
    await set_faults(http, gym, evaluate={"latency_s": 1.0})
    client = GenvClient(
        gym.url, gym.gym_id, timeouts=replace(FAST, evaluate_s=0.2, evaluate_attempts=1)
    )
    with pytest.raises(GymError, match="timed out"):
        async with client.execution(TASK) as ex:
            await ex.evaluate()
    await client.aclose()
    assert await open_executions(http, gym) == []


async def test_dropped_terminate_answers_are_retried_and_idempotent(gym, http):
    # A drop happens after the server closed the execution, so retries meet an execution
    # that is already closed; they must still count as success.
    await set_faults(http, gym, terminate={"drop_rate": 0.5})
    client = GenvClient(gym.url, gym.gym_id, timeouts=replace(FAST, terminate_attempts=10))
    for _ in range(8):
        async with client.execution(TASK):
            pass
    await client.aclose()
    assert (await counters(http, gym))["drops"] >= 1
    assert client.stats["terminate_retries"] >= 1 and client.stats["terminate_failed"] == 0
    assert await open_executions(http, gym) == []


async def test_flaky_terminate_succeeds_within_the_attempt_budget(gym, http):
    await set_faults(http, gym, terminate={"fail_rate": 0.5})
    client = GenvClient(gym.url, gym.gym_id, timeouts=replace(FAST, terminate_attempts=10))
    for _ in range(8):
        async with client.execution(TASK):
            pass
    await client.aclose()
    assert client.stats["terminate_retries"] >= 1 and client.stats["terminate_failed"] == 0
    assert await open_executions(http, gym) == []


async def test_terminate_that_never_succeeds_is_reported_with_the_execution_id(genv, gym, http):
    await set_faults(http, gym, terminate={"fail_rate": 1.0})
    with pytest.raises(GymError, match="could not be terminated") as ei:
        async with genv.execution(TASK) as ex:
            eid = ex.execution_id
    assert eid in str(ei.value)
    assert genv.stats["terminate_failed"] == 1
    assert [e["execution_id"] for e in await open_executions(http, gym)] == [eid]
    await set_faults(http, gym, terminate={"fail_rate": 0.0})
    await genv.terminate(eid)
    assert await open_executions(http, gym) == []


async def test_episode_cancelled_midway_terminates_before_the_cancellation_lands(genv, gym, http):
    await set_faults(http, gym, terminate={"latency_s": 0.3})
    entered = asyncio.Event()

    async def episode():
        async with genv.execution(TASK) as ex:
            entered.set()
            await ex.evaluate()
            await asyncio.sleep(30)

    task = asyncio.create_task(episode())
    await asyncio.wait_for(entered.wait(), 5)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # No waiting for background work: the terminate finished before the cancel propagated.
    assert await open_executions(http, gym) == []


async def test_episode_deadline_still_terminates(genv, gym, http):
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            async with genv.execution(TASK):
                await asyncio.sleep(30)
    assert await open_executions(http, gym) == []


class FlakyTransport(httpx.AsyncBaseTransport):
    """Forwards to the real server, but the first ``n`` calls whose path ends with ``suffix``
    fail in transport (before or after reaching the server)."""

    def __init__(self, suffix: str, n: int, after: bool):
        self.real = httpx.AsyncHTTPTransport()
        self.suffix, self.left, self.after = suffix, n, after

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        hit = request.url.path.endswith(self.suffix) and self.left > 0
        if hit:
            self.left -= 1
            if not self.after:
                raise httpx.ConnectError("injected connect failure", request=request)
        response = await self.real.handle_async_request(request)
        if hit:
            await response.aread()
            raise httpx.ReadError("injected read failure after the server acted", request=request)
        return response

    async def aclose(self) -> None:
        await self.real.aclose()


@pytest.mark.parametrize("after", [False, True])
async def test_client_side_transport_failures_on_terminate_are_retried(gym, http, after):
    async with httpx.AsyncClient(transport=FlakyTransport("/terminate", 2, after)) as flaky:
        client = GenvClient(gym.url, gym.gym_id, client=flaky, timeouts=FAST)
        async with client.execution(TASK):
            pass
        await client.aclose()
    assert client.stats["terminate_retries"] == 2 and client.stats["terminate_failed"] == 0
    assert await open_executions(http, gym) == []


@pytest.mark.slow
async def test_many_episodes_under_mixed_faults_leave_nothing_open(gym, http):
    await set_faults(
        http,
        gym,
        create={"fail_rate": 0.2, "latency_s": 0.01},
        evaluate={"fail_rate": 0.3, "drop_rate": 0.1},
        terminate={"fail_rate": 0.3, "drop_rate": 0.2},
    )
    client = GenvClient(gym.url, gym.gym_id, timeouts=replace(FAST, terminate_attempts=8))
    rng = random.Random(7)
    outcomes = {"ok": 0, "gym_error": 0, "cancelled": 0}

    async def episode(i: int):
        async with client.execution(TASK) as ex:
            if rng.random() < 0.3:
                raise asyncio.CancelledError  # stands in for a cancelled rollout
            await ex.evaluate(answer_text=str(i))

    async def run(i: int):
        try:
            await episode(i)
            outcomes["ok"] += 1
        except GymError:
            outcomes["gym_error"] += 1
        except asyncio.CancelledError:
            outcomes["cancelled"] += 1

    await asyncio.gather(*(run(i) for i in range(40)))
    await client.aclose()
    assert sum(outcomes.values()) == 40
    assert outcomes["gym_error"] > 0 and outcomes["ok"] > 0
    assert client.stats["terminate_failed"] == 0
    assert await open_executions(http, gym) == []


async def test_terminate_answer_body_is_ignored_but_an_error_status_is_not():
    # A hand-written fake server (MockTransport): empty 200 bodies for terminate, a 503 first.
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            return httpx.Response(503, json={"detail": "busy"})
        return httpx.Response(200, content=b"")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as fake:
        client = GenvClient("http://gym.invalid", "g", client=fake, timeouts=FAST)
        answer = await client.terminate("ex-1")
    assert answer == {"answer": ""}
    assert calls == ["/api/v1/g/executions/ex-1/terminate"] * 2
    assert client.stats["terminate_retries"] == 1


@pytest.mark.parametrize("gym_config", [SimGymConfig(max_live=1)])
async def test_create_refused_at_the_cap_is_retried_once_capacity_frees(gym, http):
    client = GenvClient(
        gym.url, gym.gym_id, timeouts=replace(FAST, backoff_s=0.2, create_refused_attempts=50)
    )
    first = await client.create_execution(TASK)

    async def free_soon():
        # Free the slot once the gym has refused a create, whatever the machine's speed.
        while (await counters(http, gym))["rejected_cap"] < 1:
            await asyncio.sleep(0.05)
        await client.terminate(first.execution_id)

    freer = asyncio.create_task(free_soon())
    second = await client.create_execution(TASK)  # 429 at first, then room
    await freer
    assert client.stats["create_refused_retries"] >= 1
    assert [e["execution_id"] for e in await open_executions(http, gym)] == [second.execution_id]
    await client.terminate(second.execution_id)
    await client.aclose()
    assert (await counters(http, gym))["rejected_cap"] == client.stats["create_refused_retries"]
