"""One MiniWoB++ episode through the whole local stack: the browser gym (a real page in headless
chromium), the local agent, vLLM CPU with the tiny Qwen2-VL behind the rollout gateway, the
training row, and a real monitor on a SQLite file; the agent loop run by the local agent service
or by the workflow itself (``agent.mode: builtin``).

The page's own reward function is observed apart from the gym's answer: MiniWoB's ``core.js``
logs ``reward: R (raw: RAW)`` to the console when it ends an episode, and the test listens to
each page's console from the moment the gym opens it. The row's reward (no shaping) and the
monitor's must equal that raw reward, or 0 when the page never ended the episode.
click-shape at the gym's seed is the task: every tap on its task area ends the episode (a wrong
shape gives -1), so most runs end with the page's own verdict.
"""

from __future__ import annotations

import re
import sqlite3

import pytest
from areal.infra import workflow_context

from cua_rl.reward import RewardConfig
from cua_rl.rollout.settings import AgentSection
from cua_rl.rollout.workflow import CUAAgentWorkflow
from cua_rl.sim.agent import AgentServer
from cua_rl.sim.browser import BrowserConfig
from cua_rl.sim.gym import GymServer, SimGymConfig
from cua_rl.tasks import load_tasks_gym, task_row

from .test_workflow import _builtin, _engine, _open_executions, _settings, monitor  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
PAGE_REWARD = re.compile(r"^reward: (-?[\d.e-]+) \(raw: (-?[\d.e-]+)\)$")


@pytest.fixture(scope="module")
def gym():
    config = SimGymConfig(
        gym_id="miniwob", backend="browser", browser=BrowserConfig(tasks=["click-shape"])
    )
    with GymServer(config) as server:
        yield server


@pytest.fixture(scope="module")
def agent():
    with AgentServer() as server:
        yield server


def listen_to_pages(gym: GymServer) -> list[str]:
    """Every console line of every page the gym opens from now on."""
    lines: list[str] = []
    backend = gym.gym.backend
    open_page = backend.open

    async def open_and_listen(task_id: str, seed: int):
        device = await open_page(task_id, seed)
        device.page.on("console", lambda message: lines.append(message.text))
        return device

    backend.open = open_and_listen
    return lines


@pytest.mark.parametrize("mode", ["service", "builtin"])
async def test_a_miniwob_episode_rewards_what_the_page_gave(
    gym,
    agent,
    vllm_server,
    tiny_vl_model_dir,
    monitor,  # noqa: F811
    mode,
):
    from cua_rl.clients.genv import GenvClient

    async with GenvClient(gym.url, gym.gym_id) as client:
        (task,) = await load_tasks_gym(client)
    console = listen_to_pages(gym)
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    settings = _settings(gym, agent, vllm_server, tiny_vl_model_dir, monitor)
    settings.reward = RewardConfig(shaping=[])
    settings.agent = AgentSection(**{**settings.agent.__dict__, "max_steps": 4})
    wf = CUAAgentWorkflow(_builtin(settings) if mode == "builtin" else settings)
    try:
        row = await wf.arun_episode(_engine(vllm_server), task_row(task))
    finally:
        await wf.aclose()
    assert row is not None
    ends = [PAGE_REWARD.match(line) for line in console if line.startswith("reward:")]
    assert len(ends) <= 1, console  # the first end of an episode is final
    page_raw = float(ends[0].group(2)) if ends else 0.0
    assert float(row["rewards"][0]) == pytest.approx(page_raw)
    assert row["multi_modal_input"][0]["image_grid_thw"].shape[0] >= 1

    db = sqlite3.connect(monitor.db_path)
    try:
        reward, status = db.execute("SELECT reward, status FROM rollout").fetchone()
        actions = db.execute("SELECT tool_name, tool_args FROM action").fetchall()
        shots = db.execute("SELECT COUNT(*) FROM screenshot").fetchone()[0]
    finally:
        db.close()
    assert status == "completed" and reward == pytest.approx(page_raw)
    assert actions and shots >= 1
    assert await _open_executions(gym) == []
