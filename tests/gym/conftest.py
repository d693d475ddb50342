"""Fixtures for the gym area: a real sim gym on a free loopback port and a genv client for it."""

from __future__ import annotations

import httpx
import pytest

from cua_rl.clients.genv import GenvClient, GenvTimeouts
from cua_rl.sim.gym import GymServer, SimGymConfig

FAST = GenvTimeouts(
    connect_s=2,
    request_s=5,
    create_s=5,
    create_grace_s=5,
    evaluate_s=5,
    terminate_s=2,
    terminate_attempts=4,
    terminate_budget_s=10,
    backoff_s=0.01,
)


@pytest.fixture
def gym_config():
    """Override in a test module (or parametrize) to change the server's configuration."""
    return SimGymConfig()


@pytest.fixture
def gym(gym_config):
    with GymServer(gym_config) as server:
        yield server


@pytest.fixture
async def genv(gym):
    async with GenvClient(gym.url, gym.gym_id, timeouts=FAST) as client:
        yield client


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


async def open_executions(http: httpx.AsyncClient, gym: GymServer) -> list[dict]:
    r = await http.get(f"{gym.base_url}/executions")
    r.raise_for_status()
    return r.json()["executions"]


async def set_faults(http: httpx.AsyncClient, gym: GymServer, **faults: dict) -> dict:
    r = await http.put(f"{gym.url}/api/v1/_sim/faults", json=faults)
    r.raise_for_status()
    return r.json()
