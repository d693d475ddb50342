"""Replay on the real local stack: sim gym, local agent, vLLM CPU with the tiny Qwen2-VL, the
rollout gateway. The train workflow records a real success of a learn-hard task and real failures;
the group filter, as AReaL's rollout worker calls it, puts the success into the failed group, and
its rows there are the rows the workflow returned for training when it ran, token for token and
pixel for pixel.

Outcomes are forced by construction, not by chance: the replies are greedy (temperature 0), so
a task's prompt always gets the same reply, and the agent's lenient grid decides where that
reply taps. One cell (1x1 grid) taps the screen's centre, where Settings has nothing: a failure.
The test then picks a grid on which the reply's first character names a cell whose centre is on
the Wi-Fi switch: a success of the same task."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3

import pytest
import torch
from areal.infra import workflow_context
from areal.utils import stats_tracker

from cua_rl.agent.service_driver import DriverConfig
from cua_rl.clients.genv import GenvClient
from cua_rl.gateway import Sampling
from cua_rl.monitor.protocol import step_client_id
from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.reward import RewardConfig
from cua_rl.rollout import groups
from cua_rl.rollout.groups import GroupSettings
from cua_rl.rollout.runtime import RolloutRuntime
from cua_rl.rollout.settings import AgentSection, EndpointSection, GymSection, WorkflowSettings
from cua_rl.rollout.workflow import CUAAgentWorkflow
from cua_rl.serving import ThreadedServer
from cua_rl.tasks import load_tasks_gym, task_row
from cua_rl.trajectory.config import TrajectoryConfig
from cua_rl.trajectory.rows import stack_rows
from cua_rl.warehouse.replay import ReplayConfig
from tests.app.test_workflow import FAST_GYM, FakeEngine, agent, gym  # noqa: F401

pytestmark = pytest.mark.slow

RUN = "replay-test"
ON, OFF = "sim-019-learn-hard-wifi-on", "sim-020-learn-hard-wifi-off"
W, H = 360, 640
SWITCH = (260, 96, 340, 136)  # the Wi-Fi switch on Settings (cua_rl/sim/phone.py)
TOKEN_KEYS = ("input_ids", "loss_mask", "logprobs", "versions", "attention_mask")
PIXEL_KEYS = ("pixel_values", "image_grid_thw", "image_keys")


def _centre(cell: int, grid: int) -> tuple[int, int]:
    row, col = divmod(cell % (grid * grid), grid)
    return int((col + 0.5) * W / grid), int((row + 0.5) * H / grid)


def _grid_on_switch(char: str) -> int:
    x0, y0, x1, y1 = SWITCH
    for grid in range(2, 80):
        x, y = _centre(ord(char), grid)
        if x0 + 2 <= x <= x1 - 2 and y0 + 2 <= y <= y1 - 2:
            return grid
    pytest.fail(f"no grid up to 79x79 puts the reply's first character {char!r} on the switch")


@pytest.fixture(scope="module")
def tasks(gym):  # noqa: F811
    async def load():
        async with GenvClient(gym.url, gym.gym_id) as client:
            return {t.id: task_row(t) for t in await load_tasks_gym(client)}

    return asyncio.run(load())


@pytest.fixture
def worker():
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    stats_tracker.get("rollout").export(reset=True)


def _workflow(
    gym,  # noqa: F811
    agent,  # noqa: F811
    vllm_server,
    model_dir,
    grid: int,
    runtime: RolloutRuntime | None = None,
    **replay_changes,
):
    """A train workflow whose lenient taps land on ``grid``'s cells; in ``runtime`` (a worker's,
    shared with another workflow), else in its engine's."""
    return CUAAgentWorkflow(
        WorkflowSettings(
            gym=GymSection(base_url=gym.url, gym_id=gym.gym_id, timeouts=FAST_GYM),
            agent=AgentSection(
                base_url=agent.url,
                agent="sim",
                max_steps=1,
                max_run_time_s=240,
                model_options={"logprobs": True, "parse": "lenient", "lenientGrid": grid},
                driver=DriverConfig(deadline_s=300),
            ),
            endpoint=EndpointSection(model_name=vllm_server.model),
            trajectory=TrajectoryConfig(),
            reward=RewardConfig(shaping=[]),
            processor_path=str(model_dir),
            sampling=Sampling(temperature=0.0, max_new_tokens=4),
            phase="train",
            group=GroupSettings(
                size=3, replay=ReplayConfig(enabled=True, **replay_changes), training=RUN
            ),
        ),
        runtime=runtime,
    )


async def _episodes(wf, engine, task: dict, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        row = await wf.arun_episode(engine, dict(task))
        assert row is not None, stats_tracker.get("rollout").export(reset=True)
        rows.append(row)
    return rows


def _reply_char(row: dict, processor) -> str:
    sampled = row["input_ids"][0][row["loss_mask"][0].bool()].tolist()
    text = processor.tokenizer.decode(sampled)
    assert text.strip(), f"an empty reply {text!r} is no lenient tap"
    return text.strip()[0]


def _assert_the_recorded_row(group: dict, rows: list[int], recorded: dict, mm: dict) -> None:
    """The replayed episode's one row in ``group`` is ``recorded``: tokens, logprobs, versions,
    masks, and the images' pixels, grids and keys (its reward is the group's advantage now)."""
    (i,) = rows
    n = int(group["attention_mask"][i].sum())
    assert n == recorded["input_ids"].shape[1]
    for key in (*TOKEN_KEYS, "mm_token_type_ids"):
        assert torch.equal(group[key][i, :n], recorded[key][0]), key
    for key in PIXEL_KEYS:
        assert torch.equal(group["multi_modal_input"][i][key], mm[key]), key


async def test_a_recorded_success_rescues_a_failed_group_with_its_exact_rows(
    gym,  # noqa: F811
    agent,  # noqa: F811
    vllm_server,
    tiny_vl_model_dir,
    tasks,
    worker,
):
    addr = vllm_server.base_url.removesuffix("/v1").removeprefix("http://")
    failing = _workflow(gym, agent, vllm_server, tiny_vl_model_dir, grid=1)
    # One rollout worker: the workflow that solves the task and the one whose group fails all
    # run in its runtime (its replay pool, its group filter).
    failing.runtime_for(FakeEngine([addr]))
    try:
        # A probe: the greedy reply to this task's prompt, and the grid that makes it a success.
        (probe,) = await _episodes(failing, FakeEngine([addr], version=3), tasks[ON], 1)
        assert float(probe["rewards"][0]) == 0.0
        grid = _grid_on_switch(_reply_char(probe, failing.processor))
        solving = _workflow(
            gym, agent, vllm_server, tiny_vl_model_dir, grid=grid, runtime=failing.runtime
        )
        (success,) = await _episodes(solving, FakeEngine([addr], version=3), tasks[ON], 1)
        assert float(success["rewards"][0]) == 1.0, f"grid {grid} did not solve {ON}"
        recorded = {k: v.clone() for k, v in success.items() if isinstance(v, torch.Tensor)}
        recorded_mm = success["multi_modal_input"][0]

        # Two versions later, a group of the same task fails entirely; the worker's filter
        # rescues it.
        engine = FakeEngine([addr], version=5)
        group = stack_rows(await _episodes(failing, engine, tasks[ON], 3))
        assert group["rewards"].tolist() == [0.0, 0.0, 0.0]
        assert failing.runtime.groups.complete_varied_groups(group)
        episodes, _, rows = groups.episode_rewards(group)
        assert episodes[-1] == int(recorded["episode_id"][0])
        advantages = group["rewards"].tolist()
        assert advantages[-1] > 0 and all(a < 0 for a in advantages[:-1])
        _assert_the_recorded_row(group, rows[-1], recorded, recorded_mm)
        stats = stats_tracker.get("rollout").export(reset=True)
        assert stats["rollout/cua/replay/rescued"] == 1.0
        assert stats["rollout/cua/replay/age"] == 2.0

        # The other task's group, failing as entirely, gets nothing: the success is not its own.
        other = stack_rows(await _episodes(failing, engine, tasks[OFF], 3))
        assert not failing.runtime.groups.complete_varied_groups(other)
        assert groups.episode_rewards(other)[1] == [0.0, 0.0, 0.0]
    finally:
        await failing.aclose()


@pytest.fixture
def monitor(tmp_path):
    """A real monitor on a SQLite file that knows two trainings (and their first steps)."""
    store = MonitorStore(str(tmp_path / "monitor.db"))
    for run in (RUN_A, RUN_B):
        store.ingest(
            {
                "training": {"run_name": run, "log_path": "logs", "model_name": "tiny-vl"},
                "steps": [
                    {"client_id": step_client_id(run, n), "training_client_id": run, "step": n}
                    for n in range(1, 7)
                ],
            }
        )
    with ThreadedServer(create_app(store), name="monitor") as server:
        server.db_path = tmp_path / "monitor.db"
        yield server
    store.close()


RUN_A, RUN_B = "replay-run-a", "replay-run-b"


async def test_a_success_another_training_stored_in_the_monitor_rescues_a_group(
    gym,  # noqa: F811
    agent,  # noqa: F811
    vllm_server,
    tiny_vl_model_dir,
    tasks,
    worker,
    monitor,
):
    addr = vllm_server.base_url.removesuffix("/v1").removeprefix("http://")

    def recorded_by(run: str, grid: int, **replay_changes) -> CUAAgentWorkflow:
        wf = _workflow(gym, agent, vllm_server, tiny_vl_model_dir, grid, **replay_changes)
        s = dataclasses.replace(wf.settings, monitor_base_url=monitor.url, training_ref=run)
        s.group = dataclasses.replace(s.group, training=run)
        return CUAAgentWorkflow(s)

    probe_wf = _workflow(gym, agent, vllm_server, tiny_vl_model_dir, grid=1)
    try:
        (probe,) = await _episodes(probe_wf, FakeEngine([addr], version=3), tasks[ON], 1)
    finally:
        await probe_wf.aclose()
    grid = _grid_on_switch(_reply_char(probe, probe_wf.processor))
    # Training A succeeds once; the monitor stores the episode (monitor.store_episodes).
    run_a = recorded_by(RUN_A, grid)
    try:
        (success,) = await _episodes(run_a, FakeEngine([addr], version=3), tasks[ON], 1)
    finally:
        await run_a.aclose()  # flushes the monitor client
    assert float(success["rewards"][0]) == 1.0

    # Training B, in a worker of its own (nothing in its pool), fails a whole group of the same
    # task.
    run_b = recorded_by(RUN_B, 1, trainings=[RUN_A])
    try:
        group = stack_rows(await _episodes(run_b, FakeEngine([addr], version=5), tasks[ON], 3))
        # AReaL calls the filter in the rollout worker's event loop, before the worker closes.
        assert run_b.runtime.groups.complete_varied_groups(group)
        assert run_b.runtime.replay is not run_a.runtime.replay
    finally:
        await run_b.aclose()  # flushes what the filter sent the monitor
    episodes, _, rows = groups.episode_rewards(group)
    assert episodes[-1] == int(success["episode_id"][0])
    # The monitor shows it: B's replaced rollout says it was not trained, and by what; A's
    # success is not touched (it belongs to another training), and no rollout was added.
    db = sqlite3.connect(monitor.db_path)
    marked = db.execute(
        "SELECT t.run_name, r.status, r.status_message FROM rollout r "
        "JOIN step s ON r.step_id = s.id JOIN training t ON s.training_id = t.id "
        "WHERE r.status_message LIKE '%replay%'"
    ).fetchall()
    per_training = db.execute(
        "SELECT t.run_name, COUNT(*) FROM rollout r JOIN step s ON r.step_id = s.id "
        "JOIN training t ON s.training_id = t.id GROUP BY t.run_name ORDER BY t.run_name"
    ).fetchall()
    db.close()
    assert len(marked) == 1 and marked[0][:2] == (RUN_B, "completed")
    assert marked[0][2].startswith("not trained: replaced by the replayed success")
    assert f"training {RUN_A}" in marked[0][2]
    assert per_training == [(RUN_A, 1), (RUN_B, 3)]
    _assert_the_recorded_row(group, rows[-1], success, success["multi_modal_input"][0])
