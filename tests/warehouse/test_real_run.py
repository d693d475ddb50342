"""A real episode's rows, stored and rebuilt: the workflow on the local stack (sim gym, local
agent, vLLM CPU serving the tiny Qwen2-VL, the rollout gateway, a real monitor on a SQLite file)
stores its accepted episode; the stored record and the exported dataset both rebuild the rows the
workflow returned for training, token for token and pixel for pixel. Under MAI-UI's context (a
row per call) each exported example is its trained row: the same ids, mask, logprobs and
versions, and its messages and images, through the model's processor, give back the row's
prompt ids exactly."""

from __future__ import annotations

import json
import sqlite3

import pytest
from areal.infra import workflow_context

from cua_rl.monitor.export import export_training
from cua_rl.monitor.server import episodes
from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.server.screenshots import default_root
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.rollout.workflow import CUAAgentWorkflow
from cua_rl.serving import ThreadedServer
from cua_rl.trajectory.rows import unstack_rows
from cua_rl.warehouse import episode_from_examples, episode_from_json, rebuild_rows
from tests.app.test_workflow import RUN, _engine, _settings, training_batch
from tests.app.test_workflow import agent as agent  # noqa: F401  (fixtures)
from tests.app.test_workflow import easy_task as easy_task  # noqa: F401
from tests.app.test_workflow import gym as gym  # noqa: F401

from .conftest import assert_rows_equal
from .test_export import load

pytestmark = pytest.mark.slow


def _stored_run(gym, agent, vllm_server, model_dir, task, folder, context=""):
    """One real train episode stored with ``store_episodes=all``: (the trained rows, the db)."""
    import asyncio

    db = folder / "monitor.db"
    store = MonitorStore(db)
    store.ingest(training_batch())
    with ThreadedServer(create_app(store), name="monitor") as monitor:
        workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
        settings = _settings(gym, agent, vllm_server, model_dir, monitor)
        settings.store_episodes = "all"  # the tiny model rarely succeeds
        settings.agent.context = context

        async def episode():
            try:
                return await wf.arun_episode(_engine(vllm_server, version=3), dict(task))
            finally:
                await wf.aclose()

        wf = CUAAgentWorkflow(settings)
        batch = asyncio.run(episode())
    store.close()
    assert batch is not None
    return unstack_rows(batch), db


@pytest.fixture(scope="module")
def run(gym, agent, vllm_server, tiny_vl_model_dir, easy_task, tmp_path_factory):  # noqa: F811
    """The agent's own context (the sim agent's: the full conversation)."""
    folder = tmp_path_factory.mktemp("wh")
    return _stored_run(gym, agent, vllm_server, tiny_vl_model_dir, easy_task, folder)


@pytest.fixture(scope="module")
def mai_ui_run(gym, agent, vllm_server, tiny_vl_model_dir, easy_task, tmp_path_factory):  # noqa: F811
    """MAI-UI's window: the request rebuilt every call, a row per call."""
    folder = tmp_path_factory.mktemp("wh-mai-ui")
    return _stored_run(gym, agent, vllm_server, tiny_vl_model_dir, easy_task, folder, "mai-ui")


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
    tok = str(tiny_vl_model_dir)
    report = export_training(db, RUN, tmp_path / "out", tokenizer=tok, progress=print)
    assert (report.episodes, report.examples, dict(report.skipped_rows)) == (1, len(rows), {})
    assert len(rows) == 1, "the full conversation trains as one row"
    ds, raw = load(tmp_path / "out")
    processor = AutoProcessor.from_pretrained(tok)
    assert_rows_equal(rebuild_rows(episode_from_examples(list(raw)), processor), rows)
    # The messages as the model received them: the sim agent's request, its screenshot(s).
    roles = [m["role"] for m in ds[0]["messages"]]
    assert roles[0] in ("system", "user") and roles[-1] == "assistant"
    assert len(ds[0]["images"]) >= 1


def test_a_mai_ui_example_round_trips_to_the_trained_rows_ids(
    mai_ui_run, tiny_vl_model_dir, tmp_path
):
    from transformers import AutoProcessor

    rows, db = mai_ui_run
    tok = str(tiny_vl_model_dir)
    report = export_training(db, RUN, tmp_path / "out", tokenizer=tok, progress=print)
    assert report.examples == len(rows) > 1, "MAI-UI's window trains a row per call"
    ds, raw = load(tmp_path / "out")
    processor = AutoProcessor.from_pretrained(tok)
    # vLLM stops at the tokenizer's end token or any of the generation config's: the reply ends
    # before whichever was sampled (the chat template writes its own).
    eos = json.loads((tiny_vl_model_dir / "generation_config.json").read_text())["eos_token_id"]
    stops = {processor.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    for example, row in zip(sorted(ds, key=lambda r: r["row"]), rows, strict=True):
        for key in ("input_ids", "loss_mask", "logprobs", "versions"):
            assert example[key] == row[key][0].tolist(), key
        cut = example["prompt_tokens"]
        assert row["loss_mask"][0, cut - 1] == 0 and row["loss_mask"][0, cut:].all()
        # The request (every message but the sampled turn) and its images, through the chat
        # template and the processor, are the trained row's prompt ids exactly.
        text = processor.apply_chat_template(
            example["messages"][:-1], add_generation_prompt=True, tokenize=False
        )
        got = processor(text=[text], images=example["images"] or None, return_tensors="pt")
        assert got["input_ids"][0].tolist() == example["input_ids"][:cut]
        sampled = example["input_ids"][cut:]
        if sampled and sampled[-1] in stops:
            sampled = sampled[:-1]
        reply = example["messages"][-1]["content"][0]["text"]
        assert reply == processor.tokenizer.decode(sampled)
    assert_rows_equal(rebuild_rows(episode_from_examples(list(raw)), processor), rows)
