"""Fixtures for the agent area: the sim gym and the local agent on free loopback ports, run
specs and executions made on demand, and a TypeScript compiler installed once into .cache/node
(the patch tests give its package to the gbox-mini-agent trees as their own)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from cua_rl.agent.spec import RunSpec
from cua_rl.sim.agent import AgentServer
from cua_rl.sim.gym import GymServer

REPO = Path(__file__).resolve().parents[2]
FIXTURE_TREE = Path(__file__).parent / "fixtures" / "gbox-mini-agent"
# The same model classes formatted differently, with other code around them.
FIXTURE_TREE_REFORMATTED = Path(__file__).parent / "fixtures" / "gbox-mini-agent-reformatted"
APPLY_SH = REPO / "patches" / "gbox-mini-agent" / "apply.sh"
TYPESCRIPT_VERSION = "5.9.3"  # pinned: the patch is checked against this compiler


@pytest.fixture
def gym():
    with GymServer() as server:
        yield server


@pytest.fixture
def agent():
    with AgentServer() as server:
        yield server


@pytest.fixture
def new_execution(gym):
    """``await new_execution(task_id=...)`` creates a gym execution and returns its id."""

    async def make(task_id: str = "sim-001-wifi-on") -> str:
        async with httpx.AsyncClient() as c:
            resp = await c.post(f"{gym.base_url}/tasks/{task_id}", json={"options": {}})
        assert resp.status_code == 200, resp.text
        return resp.json()["execution_id"]

    return make


def _spec(**overrides) -> RunSpec:
    fields = {
        "task": "Turn Wi-Fi on.",
        "model_base_url": "http://127.0.0.1:9/v1",
        "model_name": "tiny-vl",
        "gym_base_url": "http://127.0.0.1:9",
        "gym_id": "sim",
        "execution_id": "ex-unset",
        "max_steps": 3,
    }
    fields.update(overrides)
    return RunSpec(**fields)


@pytest.fixture
def spec_for(gym):
    """``spec_for(execution_id, **overrides)``: a RunSpec pointed at this test's gym."""

    def make(execution_id: str, **overrides) -> RunSpec:
        overrides.setdefault("gym_base_url", gym.url)
        overrides.setdefault("gym_id", gym.gym_id)
        return _spec(execution_id=execution_id, **overrides)

    return make


@pytest.fixture
def vllm_spec_for(spec_for, vllm_server):
    """``vllm_spec_for(execution_id, **overrides)``: as ``spec_for``, with the real vLLM model."""

    def make(execution_id: str, **overrides) -> RunSpec:
        overrides.setdefault("model_base_url", vllm_server.base_url)
        overrides.setdefault("model_name", vllm_server.model)
        return spec_for(execution_id, **overrides)

    return make


@pytest.fixture
def closed_port_url():
    """An http URL on a loopback port nothing listens on (connections are refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def tsc() -> Path:
    """The TypeScript compiler, installed into .cache/node (git-ignored) on first use."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.fail("node and npm are required to compile the patched fixture")
    cache = Path(os.environ.get("CUA_RL_CACHE", REPO / ".cache")) / "node"
    binary = cache / "node_modules" / ".bin" / "tsc"
    stamp = cache / "node_modules" / "typescript" / "package.json"
    if not (binary.exists() and f'"version": "{TYPESCRIPT_VERSION}"' in stamp.read_text()):
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--prefix", str(cache), "--no-audit", "--no-fund",
             f"typescript@{TYPESCRIPT_VERSION}"],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
    return binary


@pytest.fixture(scope="session")
def typescript_pkg(tsc) -> Path:
    """The typescript package of ``tsc``: what a checkout's node_modules holds after npm install."""
    return tsc.parent.parent / "typescript"


class FaultyTransport(httpx.AsyncBaseTransport):
    """A real HTTP transport with faults injected on chosen requests.

    ``fault(request, n)`` is called for every request (n counts from 1) and returns ``None`` to
    pass it through, an exception to raise instead (e.g. a dropped connection), or a callable
    ``(httpx.Response) -> httpx.Response`` that rewrites the real answer.
    """

    def __init__(self, fault):
        self._inner = httpx.AsyncHTTPTransport()
        self._fault = fault
        self.calls = 0
        self.injected = 0
        self.dropped_paths: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        action = self._fault(request, self.calls)
        if isinstance(action, BaseException):
            self.injected += 1
            self.dropped_paths.append(request.url.path)
            raise action
        response = await self._inner.handle_async_request(request)
        if action is None:
            return response
        await response.aread()
        self.injected += 1
        return action(response)

    async def aclose(self) -> None:
        await self._inner.aclose()
