"""``agent.mode: function`` on the real local stack: the sim gym, the rollout gateway, vLLM CPU with
the tiny Qwen2-VL and a real monitor on a SQLite file (test_workflow.py's harness). An agent
written with LangChain trains an episode unchanged; each way a function goes wrong ends as
documented (docs/agent.md, "Train your own agent"): it raises (a rejection naming the exception
and the task), it hangs (the deadline cancels it, forced by an agent that awaits what never
comes and a deadline of a fraction of a second), it never calls the model (a counted rejection),
it cannot be imported (a ``config error:`` line at load and in ``--check``). The function mode
recording as the builtin and service modes do is test_workflow.py's
``test_builtin_and_function_modes_act_record_and_train_as_the_agent_service``."""

from __future__ import annotations

import sqlite3

import httpx
import pytest
from areal.infra import workflow_context

from cua_rl.agent.function import RunEnded
from cua_rl.agent.service_driver import DriverConfig
from cua_rl.app import train
from cua_rl.app.check import check_agent
from cua_rl.errors import ConfigError
from cua_rl.rollout.settings import AgentSection
from cua_rl.rollout.workflow import CUAAgentWorkflow
from tests.agent import agents
from tests.app.conftest import load_local
from tests.app.test_workflow import (
    _engine,
    _function,
    _open_executions,
    _rollout_stats,
    _settings,
)
from tests.app.test_workflow import agent as agent  # noqa: F401  (fixtures)
from tests.app.test_workflow import easy_task as easy_task  # noqa: F401
from tests.app.test_workflow import gym as gym  # noqa: F401
from tests.app.test_workflow import monitor as monitor  # noqa: F401

LOCAL_CHECK = ("actor.path=policy", "agent.mode=function")


async def _episode(settings, vllm_server, task):
    """One train episode of ``settings``: (its row or None, its rollout stats)."""
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    _rollout_stats()
    wf = CUAAgentWorkflow(settings)
    try:
        row = await wf.arun_episode(_engine(vllm_server), dict(task))
    finally:
        await wf.aclose()
    return row, _rollout_stats()


def _function_settings(gym, agent, vllm_server, model_dir, path, monitor=None, **agent_changes):
    settings = _function(_settings(gym, agent, vllm_server, model_dir, monitor), path)
    settings.agent = AgentSection(**{**settings.agent.__dict__, **agent_changes})
    return settings


async def _rejected(stack, path: str, reason: str, **agent_changes) -> tuple[dict, str]:
    """One episode of the agent function at ``path`` on ``stack`` (gym, agent, vLLM, model,
    monitor, task): rejected with ``reason``, counted and recorded, its box terminated. (Its
    stats, the rollout's error message.)"""
    gym, agent, vllm_server, model_dir, monitor, task = stack
    settings = _function_settings(
        gym, agent, vllm_server, model_dir, path, monitor, **agent_changes
    )
    row, stats = await _episode(settings, vllm_server, task)
    assert row is None
    assert stats.get(f"rollout/cua/rejected/{reason}") == 1.0, stats
    status, message, error = _rollout_record(monitor.db_path)
    assert (status, message) == ("failed", reason)
    assert await _open_executions(gym) == []
    return stats, error


@pytest.fixture
def stack(gym, agent, vllm_server, tiny_vl_model_dir, monitor, easy_task):  # noqa: F811
    return gym, agent, vllm_server, tiny_vl_model_dir, monitor, easy_task


def _rollout_record(db_path) -> tuple:
    db = sqlite3.connect(db_path)
    try:
        return db.execute(
            "SELECT status, status_message, error_message FROM rollout ORDER BY id DESC"
        ).fetchone()
    finally:
        db.close()


@pytest.mark.slow
async def test_an_agent_written_with_langchain_trains_an_episode_unchanged(
    gym, agent, vllm_server, tiny_vl_model_dir, easy_task
):
    settings = _function_settings(
        gym, agent, vllm_server, tiny_vl_model_dir, "tests.agent.langchain_agent:run"
    )
    row, stats = await _episode(settings, vllm_server, easy_task)
    assert row is not None, stats
    assert stats["rollout/cua/accepted"] == 1.0
    # Every call LangChain's chat model made was captured, and every sampled token trained.
    assert stats["rollout/cua/gateway/calls"] == stats["rollout/cua/turns"] >= 1, stats
    assert stats["rollout/cua/trained_tokens"] == stats["rollout/cua/sampled_tokens"] > 0, stats
    assert int(row["loss_mask"].sum()) == stats["rollout/cua/trained_tokens"]
    assert await _open_executions(gym) == []


@pytest.mark.slow
async def test_a_function_that_raises_is_rejected_naming_the_exception_and_the_task(
    stack, easy_task
):
    stats, error = await _rejected(
        stack, "tests.agent.agents:raising_agent", "agent_function_error"
    )
    # Its one model call was made and captured (the gateway's counters are the episode's).
    assert stats["rollout/cua/gateway/calls"] == 1.0, stats
    for named in ("AgentBroke", "the agent broke", easy_task["task_id"], "raising_agent"):
        assert named in error, (named, error)


@pytest.mark.parametrize(
    ("limits", "setting"),
    [
        ({"driver": DriverConfig(deadline_s=0.3)}, "agent.driver.deadline_s"),
        ({"max_run_time_s": 0.3}, "agent.max_run_time_s"),
    ],
)
@pytest.mark.slow
async def test_a_function_that_hangs_is_cancelled_at_its_deadline(stack, limits, setting):
    """The agent awaits an event nobody sets: only the deadline ends its episode."""
    path = "tests.agent.agents:hanging_agent"
    _stats, error = await _rejected(stack, path, "agent_deadline", **limits)
    assert f"ran past {setting}=0.3s: cancelled" in error, error


@pytest.mark.slow
async def test_a_sync_function_that_hangs_is_left_behind_and_its_box_is_closed(
    gym, agent, vllm_server, tiny_vl_model_dir, easy_task
):
    """A thread cannot be cancelled: the episode ends at the deadline without it, and once the
    thread goes on, its next box call fails instead of acting on a box that is gone."""
    agents.RELEASE.clear()
    agents.ENDED.clear()
    agents.SEEN.clear()
    settings = _function_settings(
        gym,
        agent,
        vllm_server,
        tiny_vl_model_dir,
        "tests.agent.agents:hanging_sync_agent",
        driver=DriverConfig(deadline_s=0.3),
    )
    try:
        row, stats = await _episode(settings, vllm_server, easy_task)
        assert row is None
        assert stats.get("rollout/cua/rejected/agent_deadline") == 1.0, stats
        assert await _open_executions(gym) == []
        assert not agents.ENDED.is_set()  # still blocked in the agent
    finally:
        agents.RELEASE.set()
    assert agents.ENDED.wait(60), "the agent's thread never ended"
    assert [type(e) for e in agents.SEEN] == [RunEnded], agents.SEEN


@pytest.mark.slow
async def test_a_function_that_never_calls_the_model_is_a_counted_rejection(stack, easy_task):
    path = "tests.agent.agents:silent_agent"
    stats, error = await _rejected(stack, path, "agent_no_model_call")
    assert stats["rollout/cua/gateway/calls"] == 0.0, stats
    assert "without calling the model" in error and easy_task["task_id"] in error, error


BAD_PATHS = [
    ("tests.agent.no_such_agent:run", ["'tests.agent.no_such_agent'", "cannot be imported"]),
    ("tests.agent.agents:no_such_agent", ["'tests.agent.agents'", "has no 'no_such_agent'"]),
    ("tests.agent.agents:RELEASE", ["'RELEASE'", "not a callable"]),
    ("tests.agent.agents", ["'package.module:callable'"]),
]


@pytest.mark.parametrize(("path", "named"), BAD_PATHS)
def test_a_function_that_cannot_be_loaded_is_a_config_error_at_load_and_in_check(
    tmp_path, capsys, path, named
):
    with pytest.raises(ConfigError) as info:
        load_local(tmp_path, *LOCAL_CHECK, f"agent.function={path}")
    for part in named:
        assert part in str(info.value), (part, str(info.value))
    rc = train.main(
        ["--config", "configs/local.yaml", "--check", f"cluster.fileroot={tmp_path}"]
        + [*LOCAL_CHECK, f"agent.function={path}"]
    )
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("config error:")]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("config error: agent.function=") and all(
        p in lines[0] for p in named
    )
    assert lines[0].endswith(f"(command line: agent.function={path})"), lines[0]


def test_function_mode_needs_the_gateway_and_a_function(tmp_path):
    with pytest.raises(ConfigError, match=r"agent.function='' must be set with agent.mode="):
        load_local(tmp_path, *LOCAL_CHECK)
    with pytest.raises(ConfigError, match="set endpoint.mode=gateway"):
        load_local(
            tmp_path,
            *LOCAL_CHECK,
            "agent.function=tests.agent.agents:loop_agent",
            "endpoint.mode=direct",
        )


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("tests.agent.agents:loop_agent", "async, run in the episode's task"),
        ("tests.agent.agents:loop_agent_sync", "sync, run in a thread"),
    ],
)
async def test_check_says_how_the_function_will_run(tmp_path, path, kind):
    config = load_local(tmp_path, *LOCAL_CHECK, f"agent.function={path}")
    async with httpx.AsyncClient() as http:
        result = await check_agent(config, http)
    assert result.ok and path in result.detail and kind in result.detail, result
