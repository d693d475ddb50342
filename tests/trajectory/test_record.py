"""The run recorder (cua_rl/testing/record.py) leaks nothing when the agent or the gym fails.

These runs need no model server: a model URL on a closed port makes every agent run fail at its
first model call, which is exactly the failure to check.
"""

from __future__ import annotations

import json

import httpx
import pytest

from cua_rl.sim.agent import AgentServer
from cua_rl.sim.gym import Fault, GymServer, SimGymConfig
from cua_rl.testing.record import record_runs
from cua_rl.testing.vllm_server import free_port
from cua_rl.trajectory import convert_events


def _open(gym) -> list:
    return httpx.get(f"{gym.base_url}/executions", timeout=30).json()["executions"]


@pytest.fixture
def dead_model_url():
    return f"http://127.0.0.1:{free_port()}/v1"


async def test_failed_agent_runs_are_terminated_and_evaluated(dead_model_url):
    with GymServer() as gym, AgentServer() as agent:
        runs = await record_runs(
            gym.url, gym.gym_id, agent.url, dead_model_url, "tiny", n=2, steps=3, deadline_s=30
        )
        assert _open(gym) == []
        health = httpx.get(f"{gym.url}/healthz", timeout=30).json()
    assert [r.status for r in runs] == ["failed", "failed"]
    assert {r.reason for r in runs} == {"model_error"}
    assert len({r.execution_id for r in runs}) == 2
    # The gym still judged the untouched screen: a real verdict, not an error.
    for r in runs:
        assert r.evaluation is not None and "result" in r.evaluation
        assert r.evaluation_error is None
        assert any(e["type"] == "run_end" for e in r.events)
        # A log whose only model call failed has no turn to train on.
        res = convert_events(r.events, processor=None, reward=0.0, version=0)
        assert res.row is None and res.reason == "no_turns"
    assert health["live"] == 0


async def test_evaluate_failure_is_reported_not_scored(dead_model_url, tmp_path):
    cfg = SimGymConfig(faults={"evaluate": Fault(fail_rate=1.0)})
    with GymServer(cfg) as gym, AgentServer() as agent:
        (run,) = await record_runs(
            gym.url, gym.gym_id, agent.url, dead_model_url, "tiny", n=1, steps=2, deadline_s=30
        )
        assert _open(gym) == []
    assert run.evaluation is None
    assert "500" in run.evaluation_error
    saved = json.loads(run.save(tmp_path / "run.json").read_text())
    assert saved["events"] == run.events and saved["execution_id"] == run.execution_id


async def test_unknown_task_creates_nothing(dead_model_url):
    with GymServer() as gym, AgentServer() as agent:
        with pytest.raises(Exception, match="unknown task"):
            await record_runs(
                gym.url, gym.gym_id, agent.url, dead_model_url, "tiny", tasks=["no-such-task"]
            )
        assert _open(gym) == []
