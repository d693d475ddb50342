"""Client, event de-duplication and run driver, against the real local agent and gym.

These need no model server: a run whose model endpoint refuses connections ends at once with
reason ``model_error``, which is enough to exercise the client and the driver's bookkeeping.
Transport faults are injected with ``FaultyTransport`` around the real transport.
"""

from __future__ import annotations

import json

import httpx
import pytest

from cua_rl.agent.event_log import EventLog, event_key
from cua_rl.agent.service_driver import DriverConfig, RunDriver, drive_run
from cua_rl.clients.gbox_mini_agent import MiniAgentClient
from cua_rl.errors import AgentError, ConfigError
from tests.agent.conftest import FaultyTransport, _spec


def _event(**overrides) -> dict:
    event = {"type": "step_start", "ts": "2026-01-01T00:00:00.000Z", "step": 1}
    event.update(overrides)
    return event


def test_event_log_deduplicates_overlapping_fetches_in_server_order():
    log = EventLog()
    first = [_event(), _event(type="model_call"), _event(type="action_executed", actionIndex=0)]
    second = [
        _event(type="action_executed", actionIndex=0),  # overlap: `from` is inclusive
        _event(type="action_executed", actionIndex=1),
        _event(type="step_end", ts="2026-01-01T00:00:00.001Z"),
    ]
    assert log.add(first) == 3
    assert log.add(second) == 2
    assert [(e["type"], e.get("actionIndex")) for e in log.events] == [
        ("step_start", None),
        ("model_call", None),
        ("action_executed", 0),
        ("action_executed", 1),
        ("step_end", None),
    ]
    assert log.last_ts == "2026-01-01T00:00:00.001Z"


def test_event_key_falls_back_to_turn_for_older_servers():
    old = {"type": "step_start", "ts": 5, "turn": 2}
    assert event_key(old) == ("step_start", 5, 2, None)
    log = EventLog()
    assert log.add([old, dict(old)]) == 1


@pytest.mark.parametrize(
    "bad", [["not an object"], [{"ts": 1, "step": 1}], [{"type": "x", "ts": [1]}]]
)
def test_event_log_rejects_malformed_events(bad):
    with pytest.raises(AgentError, match="malformed event"):
        EventLog().add(bad)


def test_run_spec_body_has_the_wire_shape():
    spec = _spec(
        execution_id="ex-1",
        max_run_time_s=30,
        max_step_time_s=10,
        model_options={"constrain": "regex", "baseUrl": "ignored"},
    )
    assert spec.body() == {
        "task": "Turn Wi-Fi on.",
        "agent": "mai-ui",
        "maxSteps": 3,
        "maxRunTimeSec": 30,
        "maxStepTimeSec": 10,
        "model": {
            "constrain": "regex",
            "baseUrl": "http://127.0.0.1:9/v1",
            "name": "tiny-vl",
            "provider": "openai",
        },
        "env": {
            "type": "genv",
            "gymBaseUrl": "http://127.0.0.1:9",
            "gymId": "sim",
            "executionId": "ex-1",
        },
        "standardActionSpace": "mobile",
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"task": ""}, "task"),
        ({"model_base_url": "http://x:1"}, "/v1"),
        ({"gym_id": ""}, "gym_id"),
        ({"execution_id": ""}, "execution_id"),
        ({"max_steps": 0}, "max_steps"),
        ({"max_run_time_s": -1}, "max_run_time_s"),
        ({"action_space": "tv"}, "action_space"),
    ],
)
def test_run_spec_validation_says_what_to_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _spec(**overrides)


def test_driver_config_validation():
    with pytest.raises(ConfigError, match="poll_max_s"):
        DriverConfig(poll_initial_s=2, poll_max_s=1)
    with pytest.raises(ConfigError, match="deadline_s"):
        DriverConfig(deadline_s=0)
    with pytest.raises(ConfigError, match="base_url"):
        MiniAgentClient("127.0.0.1:80")


async def test_run_with_unreachable_model_ends_with_model_error(
    agent, gym, new_execution, spec_for, closed_port_url
):
    ex = await new_execution()
    spec = spec_for(ex, model_base_url=f"{closed_port_url}/v1")
    result = await drive_run(agent.url, spec, config=DriverConfig(deadline_s=30))
    s = result.summary
    assert (s.status, s.reason, s.steps) == ("failed", "model_error", 1)
    types = [e["type"] for e in result.events]
    assert types == ["step_start", "model_call", "error", "run_end"]
    assert result.events[-1]["ok"] is False and result.events[-1]["reason"] == "model_error"
    assert len(s.errors) == 1 and closed_port_url in s.errors[0]
    assert s.answer is None and s.ended_at >= s.started_at

    async with MiniAgentClient(agent.url) as client:
        # `from` is inclusive and `to` exclusive, on the events' own timestamps.
        middle = result.events[1]["ts"]
        assert await client.get_events(s.run_id, from_=middle) == result.events[1:]
        assert await client.get_events(s.run_id, to=middle) == result.events[:1]
        steps = await client.get_steps(s.run_id)
        assert len(steps) == 1 and steps[0]["index"] == 0
        assert await client.get_step(s.run_id, 0) == steps[0]
        assert await client.get_step(s.run_id, 1) is None
        assert (await client.get_trajectory(s.run_id))["status"] == "failed"
        assert (await client.get_tokens(s.run_id))["steps"] == []
        with pytest.raises(AgentError) as err:
            await client.get_run("run-does-not-exist")
        assert err.value.status == 404


async def test_create_failure_is_a_summary_not_an_exception(closed_port_url):
    cfg = DriverConfig(create_connect_wait_s=0)
    result = await drive_run(closed_port_url, _spec(execution_id="ex-1"), config=cfg)
    assert result.summary.status == "failed" and result.summary.reason == "create_failed"
    assert result.summary.run_id is None and result.events == []
    assert "ConnectError" in result.summary.errors[0]


async def test_create_waits_out_an_agent_that_cannot_be_reached_yet(
    agent, gym, new_execution, spec_for, closed_port_url
):
    # The first two creates find no listener (an agent restarting): never sent, so retried.
    ex = await new_execution()
    transport = FaultyTransport(
        lambda req, n: (
            httpx.ConnectError("agent restarting", request=req)
            if req.method == "POST" and n <= 2
            else None
        )
    )
    async with httpx.AsyncClient(transport=transport) as http:
        spec = spec_for(ex, model_base_url=f"{closed_port_url}/v1")
        cfg = DriverConfig(deadline_s=30, poll_initial_s=0.05, poll_max_s=0.2)
        result = await drive_run(agent.url, spec, config=cfg, client=http)
    s = result.summary
    assert s.create_retries == 2 and s.run_id is not None
    assert (s.status, s.reason) == ("failed", "model_error")  # the run itself went on


async def test_a_create_whose_answer_was_lost_is_not_retried(
    agent, gym, new_execution, spec_for, closed_port_url
):
    ex = await new_execution()
    transport = FaultyTransport(
        lambda req, n: httpx.ReadError("answer lost", request=req) if req.method == "POST" else None
    )
    async with httpx.AsyncClient(transport=transport) as http:
        spec = spec_for(ex, model_base_url=f"{closed_port_url}/v1")
        result = await drive_run(agent.url, spec, config=DriverConfig(deadline_s=30), client=http)
    s = result.summary
    assert (s.reason, s.create_retries, transport.injected) == ("create_failed", 0, 1)


async def test_agent_refuses_bad_run_bodies_with_a_message(agent):
    async with MiniAgentClient(agent.url) as client:
        body = _spec(execution_id="ex-1").body()
        for field, value, message in [
            ("maxSteps", 0, "maxSteps"),
            ("env", {"type": "docker"}, "env"),
            ("model", {"baseUrl": "http://x/v1"}, "model"),
            ("task", "", "task"),
        ]:
            with pytest.raises(AgentError) as err:
                await client.create_run({**body, field: value})
            assert err.value.status == 400 and message in str(err.value)
        bad_model = {**body["model"], "constrain": "grammar"}
        with pytest.raises(AgentError, match="constrain"):
            await client.create_run({**body, "model": bad_model})


async def test_client_accepts_both_event_shapes_and_404_as_none_yet():
    answers = {
        "/runs/a/events": httpx.Response(200, json=[_event()]),
        "/runs/b/events": httpx.Response(200, json={"events": [_event()]}),
        "/runs/c/events": httpx.Response(404, json={"detail": "no events yet"}),
        "/runs/d/events": httpx.Response(200, json={"events": "nope"}),
        "/runs/e": httpx.Response(200, text="<html>"),
        "/runs": httpx.Response(200, json={"ok": True}),
    }
    transport = httpx.MockTransport(lambda req: answers[req.url.path])
    async with httpx.AsyncClient(transport=transport) as http:
        client = MiniAgentClient("http://agent.invalid", client=http)
        assert await client.get_events("a") == [_event()]
        assert await client.get_events("b") == [_event()]
        assert await client.get_events("c") == []
        with pytest.raises(AgentError, match="not a list"):
            await client.get_events("d")
        with pytest.raises(AgentError, match="non-JSON"):
            await client.get_run("e")
        with pytest.raises(AgentError, match="runId"):
            await client.create_run({})


async def test_driver_tolerates_unknown_statuses_and_transient_failures(
    agent, gym, new_execution, spec_for, closed_port_url
):
    ex = await new_execution()

    def fault(request: httpx.Request, n: int):
        if request.method == "GET" and n % 3 == 0:
            return httpx.ReadError("connection dropped by fault injection", request=request)
        if request.method == "GET" and request.url.path.count("/") == 2 and n < 6:

            def relabel(resp: httpx.Response) -> httpx.Response:
                data = json.loads(resp.content)
                data["status"] = "warming-up"
                return httpx.Response(200, json=data)

            return relabel
        return None

    transport = FaultyTransport(fault)
    async with httpx.AsyncClient(transport=transport) as http:
        spec = spec_for(ex, model_base_url=f"{closed_port_url}/v1")
        cfg = DriverConfig(deadline_s=30, poll_initial_s=0.05, poll_max_s=0.2)
        result = await drive_run(agent.url, spec, config=cfg, client=http)
    s = result.summary
    assert transport.injected >= 2 and s.transient_errors >= 1
    assert s.unknown_statuses == ["warming-up"]
    assert (s.status, s.reason) == ("failed", "model_error")
    assert [e["type"] for e in result.events] == ["step_start", "model_call", "error", "run_end"]


async def test_driver_gives_up_after_bounded_failures(
    agent, gym, new_execution, spec_for, closed_port_url
):
    ex = await new_execution()
    transport = FaultyTransport(
        lambda req, n: (
            httpx.ConnectError("agent gone", request=req) if req.method == "GET" else None
        )
    )
    async with httpx.AsyncClient(transport=transport) as http:
        spec = spec_for(ex, model_base_url=f"{closed_port_url}/v1")
        cfg = DriverConfig(
            deadline_s=30, poll_initial_s=0.01, poll_max_s=0.02, max_consecutive_errors=3
        )
        result = await RunDriver(MiniAgentClient(agent.url, client=http), cfg).run(spec)
    s = result.summary
    assert s.reason == "agent_error" and s.run_id is not None
    # Each poll makes two calls (status and events), both failing: 4 polls in a row, 8 failures.
    assert s.transient_errors == 8 and "4 failures in a row" in s.errors[-1]


async def test_driver_bounds_status_failures_even_while_events_flow(
    agent, gym, new_execution, spec_for, closed_port_url
):
    ex = await new_execution()

    def drop_status(request: httpx.Request, n: int):
        if request.method == "GET" and not request.url.path.endswith("/events"):
            return httpx.RemoteProtocolError("status endpoint drops", request=request)
        return None

    transport = FaultyTransport(drop_status)
    async with httpx.AsyncClient(transport=transport) as http:
        spec = spec_for(ex, model_base_url=f"{closed_port_url}/v1")
        cfg = DriverConfig(
            deadline_s=60, poll_initial_s=0.01, poll_max_s=0.02, max_consecutive_errors=5
        )
        result = await drive_run(agent.url, spec, config=cfg, client=http)
    s = result.summary
    # Gave up on the 6th failed status poll, long before the deadline; the events that did
    # arrive are kept.
    assert (s.reason, s.transient_errors) == ("agent_error", 6)
    assert s.duration_s < 30
    assert result.events and result.events[0]["type"] == "step_start"


@pytest.fixture
def silent_port_url():
    """An http URL whose server accepts connections and never answers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


async def test_max_step_time_ends_a_step_whose_model_never_answers(
    agent, gym, new_execution, spec_for, silent_port_url
):
    # The step's limit covers its screenshot and request too: 1 s ran out before the model call
    # on a loaded CI machine. 5 s leaves that work room; the model's silence does the rest, and
    # the run's own deadline (60 s) would end it with another reason if the step limit did not.
    ex = await new_execution()
    spec = spec_for(ex, model_base_url=f"{silent_port_url}/v1", max_step_time_s=5)
    result = await drive_run(agent.url, spec, config=DriverConfig(deadline_s=60))
    s = result.summary
    assert (s.status, s.reason, s.steps) == ("failed", "step_timeout", 1)
    assert [e["type"] for e in result.events] == ["step_start", "model_call", "error", "run_end"]
    assert "maxStepTimeSec=5" in s.errors[0]
