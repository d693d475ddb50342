"""A finished run's record leaves the agent's memory and stays readable, unchanged, over HTTP.

Real local gym and agent on loopback, and a scripted OpenAI-style model that taps once and then
finishes, answering token ids as vLLM does (``cua_rl.testing.chat_model``), so every part of a
run's record (events with the screenshots as data URLs, steps, tokens) is there to be moved to
disk and read back.
"""

from __future__ import annotations

import asyncio
import base64
import copy

import httpx
import pytest

from cua_rl.agent.run import Run
from cua_rl.agent.service_driver import DriverConfig, drive_run
from cua_rl.clients.gbox_mini_agent import MiniAgentClient
from cua_rl.core.spill import Spill
from cua_rl.sim.agent import AgentServer, AgentServerConfig
from cua_rl.testing.chat_model import ScriptedChatModel
from tests.conftest import open_files_under


@pytest.fixture
def model():
    m = ScriptedChatModel()
    with m.server:
        yield m


async def _health(agent) -> dict:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(f"{agent.url}/healthz")).json()


async def _drive(agent, new_execution, spec_for, model):
    spec = spec_for(await new_execution(), model_base_url=f"{model.server.url}/v1")
    return await drive_run(agent.url, spec, config=DriverConfig(deadline_s=60))


def _data_urls(events: list[dict]) -> list[str]:
    return [
        part["image_url"]["url"]
        for ev in events
        if ev["type"] == "model_call"
        for msg in ev["modelSpecificInput"]["messages"]
        if isinstance(msg.get("content"), list)
        for part in msg["content"]
        if part.get("type") == "image_url"
    ]


async def test_a_finished_run_is_read_back_from_disk_unchanged(
    gym, new_execution, spec_for, model, tmp_path
):
    with AgentServer(AgentServerConfig(spill_dir=str(tmp_path))) as agent:
        result = await _drive(agent, new_execution, spec_for, model)
        s = result.summary
        assert (s.status, s.reason, s.steps) == ("completed", "finished", 2)
        health = await _health(agent)
        assert health["runs"] == 1 and health["runs_in_memory"] == 0
        assert health["disk_bytes"] == health["spilled_bytes"] > 0
        # An unnamed file in the given folder: nothing to clean up even if the agent is killed.
        assert list(tmp_path.iterdir()) == []
        assert [t.endswith(" (deleted)") for t in open_files_under(tmp_path)] == [True]
        async with MiniAgentClient(agent.url) as client, httpx.AsyncClient() as http:
            # Everything the driver followed while the run was live, read again from the file.
            assert await client.get_events(s.run_id) == result.events
            steps = await client.get_steps(s.run_id)
            assert [len(st["actions"]) for st in steps] == [1, 1]
            assert (await client.get_trajectory(s.run_id))["steps"] == steps
            tokens = (await client.get_tokens(s.run_id))["steps"]
            assert [len(t["prompt_token_ids"]) for t in tokens] == [500, 1000]
            # The screenshots the model was shown are the gym's own bytes.
            urls = _data_urls(result.events)
            befores = [
                st["actions"][0]["obs"]["screenshots"][0]["screenshot_before"] for st in steps
            ]
            assert len(urls) >= 2
            for data_url, url in zip(urls[-2:], befores, strict=True):
                png = (await http.get(url)).content
                assert base64.b64decode(data_url.split(",", 1)[1]) == png
    assert open_files_under(tmp_path) == []  # closed, so freed, when the service stopped


async def test_the_oldest_finished_run_is_dropped_with_its_record(
    gym, new_execution, spec_for, model, tmp_path
):
    config = AgentServerConfig(spill_dir=str(tmp_path), max_runs_kept=1)
    with AgentServer(config) as agent:
        first = await _drive(agent, new_execution, spec_for, model)
        second = await _drive(agent, new_execution, spec_for, model)
        health = await _health(agent)
        assert health["runs"] == 1 and health["spilled_bytes"] < health["disk_bytes"]
        async with MiniAgentClient(agent.url) as client:
            assert await client.get_events(second.summary.run_id) == second.events
            assert await client.get_trajectory(first.summary.run_id) is None


async def test_a_run_that_cannot_spill_stays_in_memory_counted(
    gym, new_execution, spec_for, model, tmp_path
):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with AgentServer(AgentServerConfig(spill_dir=str(not_a_dir))) as agent:
        result = await _drive(agent, new_execution, spec_for, model)
        health = await _health(agent)
        assert (health["runs_in_memory"], health["spill_errors"]) == (1, 1)
        async with MiniAgentClient(agent.url) as client:
            assert await client.get_events(result.summary.run_id) == result.events


async def test_spill_round_trips_a_run_and_refuses_a_running_one(tmp_path):
    run = Run("run-1", {"task": "t"})
    run.emit("step_start", 1)
    run.emit("model_call", 1, modelSpecificInput={"messages": [{"role": "user", "content": "x"}]})
    run.steps.append({"index": 0, "actions": []})
    run.tokens.append({"step": 1, "prompt_token_ids": [1, 2, 3]})
    run.emit("run_end", 1, ok=True, reason="finished")
    spill = Spill(str(tmp_path))
    run.task = asyncio.get_running_loop().create_future()
    with pytest.raises(RuntimeError, match="still running"):
        run.spill(spill)
    run.task.set_result(None)
    before = copy.deepcopy((run.events, run.steps, run.tokens))
    ms_before = list(run._event_ms)
    run.spill(spill)
    assert run._events == [] and run._steps == [] and run._tokens == []
    assert (run.events, run.steps, run.tokens) == before
    assert run.events_between(ms_before[1], None) == before[0][1:]
    assert run.events_between(None, ms_before[1]) == before[0][:1]
    spill.close()
