"""Wrong gym and agent URLs and unreachable services are one line with the fix, against the real
sim gym and the real local agent service."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cua_rl.clients.gbox_mini_agent import AgentUnreachable, MiniAgentClient
from cua_rl.clients.genv import GenvClient, GenvTimeouts
from cua_rl.errors import AgentError, ConfigError, GymError
from cua_rl.serving import bind_free_port
from cua_rl.sim.gym import GymServer
from cua_rl.testing.cache import ensure_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def dead_url():
    sock = bind_free_port()  # bound, never listening: connections are refused
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


async def _list(base_url: str, gym_id: str):
    async with GenvClient(base_url, gym_id, timeouts=GenvTimeouts(read_attempts=1)) as client:
        return await client.list_tasks()


def test_the_api_url_the_gym_prints_is_refused_with_its_root():
    with GymServer() as gym:
        # What the sim gym prints as ready: the API URL, not the base URL the client wants.
        with pytest.raises(ConfigError) as info:
            GenvClient(gym.base_url, gym.gym_id)
        assert f"give the server root, e.g. {gym.url} " in str(info.value)
        assert asyncio.run(_list(gym.url, gym.gym_id))  # the root works


def test_a_wrong_gym_id_or_path_is_a_404_that_names_both_keys():
    with GymServer() as gym:
        with pytest.raises(GymError) as info:
            asyncio.run(_list(gym.url, "nosuch"))
    assert info.value.status == 404
    assert "check gym.base_url and gym.gym_id" in str(info.value)


def test_an_unreachable_gym_names_its_address(dead_url):
    with pytest.raises(GymError) as info:
        asyncio.run(_list(dead_url, "sim"))
    assert f"nothing answers at {dead_url}" in str(info.value)
    assert "fix the host and port of gym.base_url" in str(info.value)


async def _run_status(base_url: str):
    async with MiniAgentClient(base_url) as client:
        return await client.get_run("nosuch")


def test_a_run_url_as_the_agent_base_url_is_refused_with_its_root():
    with pytest.raises(ConfigError, match=r"has /runs in it: give http://127.0.0.1:3000$"):
        MiniAgentClient("http://127.0.0.1:3000/runs/abc")


def test_an_agent_url_that_is_not_the_service_root_names_the_key():
    with GymServer() as gym:  # a live server that is not the agent: every agent path is a 404
        with pytest.raises(AgentError) as info:
            asyncio.run(_run_status(gym.url))
    assert info.value.status == 404
    assert f"is {gym.url} the agent service's root? check agent.base_url" in str(info.value)


def test_an_unreachable_agent_names_its_address(dead_url):
    with pytest.raises(AgentUnreachable) as info:
        asyncio.run(_run_status(dead_url))
    assert f"nothing answers at {dead_url}" in str(info.value)
    assert "fix the host and port of agent.base_url" in str(info.value)


def test_the_launcher_reports_an_unreachable_gym_in_one_line(tmp_path, dead_url):
    # Without --check: before, a raw traceback.
    argv = [
        "--config",
        str(ROOT / "configs" / "local.yaml"),
        f"cluster.fileroot={tmp_path}",
        f"actor.path={ensure_model('qwen2-vl-byte')}",
        f"gym.base_url={dead_url}",
        "gym.timeouts.read_attempts=1",
        "monitor.enabled=false",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "examples.cua_agent.train", *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("service error: gym ") and f"nothing answers at {dead_url}" in last
    assert "--check" in last
