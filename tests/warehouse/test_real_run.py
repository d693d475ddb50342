"""A real episode's rows, stored and rebuilt: the workflow on the local stack (sim gym, local
agent, vLLM CPU serving the tiny Qwen2-VL, the rollout gateway, a real monitor on a SQLite file)
stores its accepted episode; the stored record and the exported dataset both rebuild the rows the
workflow returned for training, token for token and pixel for pixel."""

from __future__ import annotations

import sqlite3

import pytest
from areal.infra import workflow_context

from cua_rl.monitor.export import episode_from_record, export_training
from cua_rl.monitor.server import episodes
from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.server.screenshots import default_root
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.rollout.workflow import CUAAgentWorkflow
from cua_rl.serving import ThreadedServer
from cua_rl.trajectory.rows import unstack_rows
from cua_rl.warehouse import episode_from_json, rebuild_rows
from tests.app.test_workflow import RUN, _engine, _settings, training_batch
from tests.app.test_workflow import agent as agent  # noqa: F401  (fixtures)
from tests.app.test_workflow import easy_task as easy_task  # noqa: F401
from tests.app.test_workflow import gym as gym  # noqa: F401

from .conftest import assert_rows_equal
from .test_export import load

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(gym, agent, vllm_server, tiny_vl_model_dir, easy_task, tmp_path_factory):  # noqa: F811
    """One real train episode stored with ``store_episodes=all``: (the trained rows, the db)."""
    import asyncio

    db = tmp_path_factory.mktemp("wh") / "monitor.db"
    store = MonitorStore(db)
    store.ingest(training_batch())
    with ThreadedServer(create_app(store), name="monitor") as monitor:
        workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
        settings = _settings(gym, agent, vllm_server, tiny_vl_model_dir, monitor)
        settings.store_episodes = "all"  # the tiny model rarely succeeds
        wf = CUAAgentWorkflow(settings)

        async def episode():
            try:
                return await wf.arun_episode(_engine(vllm_server, version=3), dict(easy_task))
            finally:
                await wf.aclose()

        batch = asyncio.run(episode())
    store.close()
    assert batch is not None
    return unstack_rows(batch), db


def test_the_stored_record_rebuilds_the_rows_the_workflow_trained(run, tiny_vl_model_dir):
    from transformers import AutoProcessor

    rows, db = run
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    (found,) = list(episodes.training_episodes(conn, RUN))
    conn.close()
    ep = episode_from_json(episodes.to_json(found))
    shots = default_root(db)
    ep.images = {h: (shots / h[:2] / h).read_bytes() for h in ep.image_hashes}
    assert ep.image_hashes, "the episode's screenshots are stored"
    assert (ep.version_min, ep.version_max) == (3, 3)
    processor = AutoProcessor.from_pretrained(str(tiny_vl_model_dir))
    assert_rows_equal(rebuild_rows(ep, processor), rows)


def test_the_export_of_a_real_run_round_trips(run, tiny_vl_model_dir, tmp_path):
    from transformers import AutoProcessor

    rows, db = run
    report = export_training(db, RUN, tmp_path / "out", progress=print)
    assert (report.episodes, dict(report.skipped)) == (1, {})
    ds, raw = load(tmp_path / "out")
    processor = AutoProcessor.from_pretrained(str(tiny_vl_model_dir))
    assert_rows_equal(rebuild_rows(episode_from_record(raw[0]), processor), rows)
    # The messages as the model received them: the sim agent's request, its screenshot(s).
    roles = [m["role"] for m in ds[0]["messages"]]
    assert roles[0] in ("system", "user") and roles[-1] == "assistant"
    assert len(ds[0]["images"]) >= 1
    assert all(t["output_ids"] for t in ds[0]["turns"])
