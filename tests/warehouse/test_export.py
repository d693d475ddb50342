"""``python -m cua_rl.monitor export`` on hand-built episodes: one example per trained row, its
request as the model received it and the reply it sampled, decoded from the recorded ids; the
token data rebuilds the trained rows exactly; the filters, the counted and printed skips, the
errors, Parquet, the dataset card, the command line and the dashboard's rollout export link.
The consumers (the processor, a forward pass, TRL) on real trainings: test_export_consumers.py."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from cua_rl.monitor.export import ExportError, Filters, export_episodes, export_training
from cua_rl.monitor.protocol import EPISODE_KIND
from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.server.migrations import connect, migrate
from cua_rl.monitor.server.schema import MIGRATIONS
from cua_rl.monitor.server.screenshots import ScreenshotStore
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.serving import ThreadedServer
from cua_rl.warehouse import episode_from_examples, rebuild_rows, to_record
from tests.trajectory.test_convert_unit import _two_turn_log

from .conftest import RUN, assert_rows_equal, rollout_batch, stored


def config(model_dir, context="full") -> dict:
    """What a training records of its config that the export reads."""
    return {"tokenizer_path": str(model_dir), "agent": {"context": context}}


def record_in(db, episodes, *, cfg=None, run=RUN, step=1) -> None:
    """The episodes, their rollouts and their images in a monitor database, as ingest does."""
    store = MonitorStore(db)
    shots = ScreenshotStore(db)
    try:
        for ep in episodes:
            store.ingest(rollout_batch(ep.rollout_uuid, ep.task_id, step, run=run, config=cfg))
            for digest, data in ep.images.items():
                shots.put(digest, data)
            store.ingest({EPISODE_KIND: [to_record(ep)]})
    finally:
        shots.close()
        store.close()


def load(out):
    """The export at ``out`` (decoded) and the same with its images as bytes."""
    from datasets import Image, List, load_from_disk

    ds = load_from_disk(str(out))
    return ds, ds.cast_column("images", List(Image(decode=False)))


def placeholders(example) -> int:
    return sum(p["type"] == "image" for m in example["messages"] for p in m["content"])


@pytest.fixture(scope="module")
def replies(images, processor):
    """The hand-built log's sampled replies as its tokenizer writes them (stop token left out)."""
    _, (_, o1, _), (_, o2, _) = _two_turn_log(images)
    return processor.tokenizer.decode(o1[:-1]), processor.tokenizer.decode(o2[:-1])


def test_a_row_per_call_is_an_example_each_with_its_request_and_sampled_reply(
    images, processor, tiny_vl_model_dir, replies, tmp_path
):
    ep, result = stored(images, processor, uuid="r-x", break_prefix=True)  # a row per call
    record_in(tmp_path / "monitor.db", [ep], cfg=config(tiny_vl_model_dir, "mai-ui"))
    lines = []
    report = export_training(tmp_path / "monitor.db", RUN, tmp_path / "out", progress=lines.append)
    assert (report.episodes, report.examples, report.images) == (1, 2, 3)
    ds, raw = load(tmp_path / "out")
    assert [r["row"] for r in ds] == [0, 1]
    _, (p1, o1, _), (p2, o2, l2) = _two_turn_log(images, break_prefix=True)
    first, second = ds[0], ds[1]
    # Each call's own request and images, the reply it sampled last.
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant"]
    assert first["messages"][-1]["content"] == [{"type": "text", "text": replies[0]}]
    assert second["messages"][2]["content"][0]["text"] == "ab"  # the request's history as sent
    assert second["messages"][-1]["content"] == [{"type": "text", "text": replies[1]}]
    assert [placeholders(first), len(first["images"])] == [1, 1]
    assert [placeholders(second), len(second["images"])] == [2, 2]
    assert first["images"][0].size == (360, 640) and second["images"][1].size == (280, 280)
    # The exact token data, and where the sampled reply starts.
    assert (first["input_ids"], first["prompt_tokens"]) == (p1 + o1, len(p1))
    assert (second["input_ids"], second["prompt_tokens"]) == (p2 + o2, len(p2))
    assert second["logprobs"][len(p2) :] == l2 and second["versions"][len(p2) :] == [4] * 4
    assert [(r["turn"], r["agent_step"]) for r in ds] == [(0, 1), (1, 2)]
    assert [(r["context"], r["training"], r["training_step"]) for r in ds] == [
        ("mai-ui", RUN, 1)
    ] * 2
    assert first["success"] and first["reward"] == 1.0 and first["episode_rows"] == 2
    assert_rows_equal(rebuild_rows(episode_from_examples(list(raw)), processor), result.rows)
    assert any("wrote 2 example(s) of 1 episode(s), 3 image(s)" in line for line in lines)


def test_an_append_only_episode_is_one_example(
    images, processor, tiny_vl_model_dir, replies, tmp_path
):
    ep, result = stored(images, processor, uuid="r-one", break_prefix=False)
    record_in(tmp_path / "monitor.db", [ep], cfg=config(tiny_vl_model_dir))
    report = export_training(tmp_path / "monitor.db", RUN, tmp_path / "out", progress=print)
    assert (report.episodes, report.examples) == (1, 1)
    ds, raw = load(tmp_path / "out")
    (only,) = ds
    roles = [m["role"] for m in only["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert only["messages"][-1]["content"][0]["text"] == replies[1]
    assert [t["index"] for t in only["turns"]] == [0, 1] and only["turn"] == 1
    assert placeholders(only) == len(only["images"]) == 2
    assert_rows_equal(rebuild_rows(episode_from_examples(list(raw)), processor), result.rows)


def _with_rewards(images, processor, specs):
    """Stored episodes from (uuid, reward, success) triples."""
    out = []
    for uuid, reward, success in specs:
        ep, _ = stored(images, processor, uuid=uuid, success=success)
        ep.reward = reward
        out.append(ep)
    return out


def test_filters_successes_reward_floor_context_and_step_range(
    images, processor, tiny_vl_model_dir, tmp_path
):
    db = tmp_path / "monitor.db"
    eps = _with_rewards(
        images,
        processor,
        [("s1-ok", 1.0, True), ("s2-fail", 0.25, False), ("s3-half", 0.5, False)],
    )
    for step, ep in enumerate(eps, 1):
        record_in(db, [ep], cfg=config(tiny_vl_model_dir, "mai-ui"), step=step)
    other, _ = stored(images, processor, uuid="full-ok")
    record_in(db, [other], cfg=config(tiny_vl_model_dir, "full"), run="other-run")

    def exported(name, **kw):
        export_episodes(db, tmp_path / name, Filters(**kw), progress=print)
        return sorted({r["rollout_uuid"] for r in load(tmp_path / name)[0]})

    assert exported("all") == ["full-ok", "s1-ok", "s2-fail", "s3-half"]
    assert exported("wins", trainings=(RUN,), success_only=True) == ["s1-ok"]
    assert exported("floor", trainings=(RUN,), min_reward=0.5) == ["s1-ok", "s3-half"]
    assert exported("mai", context="mai-ui") == ["s1-ok", "s2-fail", "s3-half"]
    assert exported("full", context="full") == ["full-ok"]
    assert exported("mid", min_step=2, max_step=2) == ["s2-fail"]
    assert exported("late", trainings=(RUN,), min_step=3) == ["s3-half"]
    with pytest.raises(ExportError, match=r"no training ran with context 'current'"):
        export_episodes(db, tmp_path / "x", Filters(context="current"))
    with pytest.raises(ExportError, match=r"no training ran with context 'full' \(wh-run: mai-ui"):
        export_episodes(db, tmp_path / "x", Filters(trainings=(RUN,), context="full"))


def test_each_skip_reason_is_counted_printed_and_named_in_the_card(
    images, processor, tiny_vl_model_dir, tmp_path
):
    ok, _ = stored(images, processor, uuid="r-ok")
    unlogged, _ = stored(images, processor, uuid="r-unlogged")
    unlogged.rows[0].messages = None  # the agent logged no request for that call
    miscounted, _ = stored(images, processor, uuid="r-miscounted")
    miscounted.rows[1].messages[-1]["content"].append({"type": "image"})  # 3 placeholders, 2 images
    db = tmp_path / "monitor.db"
    record_in(db, [ok, unlogged, miscounted], cfg=config(tiny_vl_model_dir))
    lost, _ = stored(images, processor, uuid="r-lost")
    store = MonitorStore(db)  # an episode whose images never reached the monitor
    store.ingest(rollout_batch(lost.rollout_uuid))
    lost.rows[0].images = ("f" * 64,)
    store.ingest({EPISODE_KIND: [to_record(lost)]})
    store.close()
    lines = []
    report = export_training(db, RUN, tmp_path / "out", progress=lines.append)
    assert (report.matched, report.episodes, report.examples) == (4, 3, 4)
    assert dict(report.skipped_episodes) == {"image_missing": 1}
    assert dict(report.skipped_rows) == {"no_messages": 1, "image_placeholders": 1}
    printed = "\n".join(lines)
    assert "2 skipped" not in printed and "3 skipped" in printed
    for said in (
        "skipped 1 episode(s): image_missing (an image of the episode is not in",
        "skipped 1 row(s): no_messages (the agent logged no request",
        "skipped 1 row(s): image_placeholders (the request names another number of images",
    ):
        assert any(said in line for line in lines), printed
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| episode | `image_missing` | 1 |" in card
    assert "| row | `no_messages` | 1 |" in card and "| row | `image_placeholders` | 1 |" in card
    uuids = [r["rollout_uuid"] for r in load(tmp_path / "out")[0]]
    assert sorted(uuids) == ["r-miscounted", "r-ok", "r-ok", "r-unlogged"]


def test_clear_errors(images, processor, tiny_vl_model_dir, tmp_path):
    ep, _ = stored(images, processor, uuid="r-failed", success=False)
    db = tmp_path / "monitor.db"
    record_in(db, [ep], cfg={"agent": {"context": "full"}})  # no tokenizer recorded
    with pytest.raises(ExportError, match=r"no training named 'nope'.*newest: wh-run"):
        export_training(db, "nope", tmp_path / "out")
    with pytest.raises(ExportError, match="1 stored, 0 successes"):
        export_training(db, RUN, tmp_path / "out", success_only=True)
    with pytest.raises(ExportError, match=r"none matches|no stored episode matches"):
        export_training(db, RUN, tmp_path / "out", min_reward=2.0)
    with pytest.raises(ExportError, match="tokenizer '' is not a folder here: pass --tokenizer"):
        export_training(db, RUN, tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_training(db, RUN, tmp_path / "full", tokenizer=str(tiny_vl_model_dir))
    with pytest.raises(ExportError, match="format 'csv'"):
        export_training(db, RUN, tmp_path / "out", fmt="csv")
    old = tmp_path / "old.db"
    migrate(connect(old), MIGRATIONS[:4])
    with pytest.raises(ExportError, match="schema version 4.*migration 5"):
        export_training(old, RUN, tmp_path / "out")


def _same_records(a, b) -> None:
    keys = ("rollout_uuid", "row", "messages", "input_ids", "loss_mask", "logprobs", "versions")
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}
        assert [i["bytes"] for i in x["images"]] == [i["bytes"] for i in y["images"]]


def test_the_command_line_parquet_and_the_card(images, processor, tiny_vl_model_dir, tmp_path):
    from datasets import Image, List, load_dataset

    ep, _ = stored(images, processor, uuid="r-cli")
    db = tmp_path / "monitor.db"
    record_in(db, [ep], cfg=config(tiny_vl_model_dir, "current"))
    cmd = [sys.executable, "-m", "cua_rl.monitor", "export", "--db", str(db)]
    for fmt in ("arrow", "parquet"):
        done = subprocess.run(
            [*cmd, "--training", RUN, "--context", "current", "--format", fmt, "--out"]
            + [str(tmp_path / fmt)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert "wrote 2 example(s) of 1 episode(s), 3 image(s)" in done.stderr
    parquet = load_dataset(str(tmp_path / "parquet"), split="train")  # found through the card
    assert (tmp_path / "parquet" / "data" / "train-00000-of-00001.parquet").is_file()
    undecoded = List(Image(decode=False))
    _same_records(list(parquet.cast_column("images", undecoded)), list(load(tmp_path / "arrow")[1]))
    card = (tmp_path / "parquet" / "README.md").read_text()
    assert "path: data/train-*.parquet" in card and f"# cua-rl export: {RUN}" in card
    assert f"| {RUN} | tiny-vl | current | 1 | 1 |" in card  # training, model, context, counts
    assert "| 1 | 1 | 2 | 3 | parquet |" in card and "Nothing was skipped." in card
    for column in ("messages", "images", "input_ids", "loss_mask", "logprobs", "versions"):
        assert f"| `{column}` |" in card
    bad = subprocess.run(
        [*cmd, "--training", "nope", "--out", str(tmp_path / "o2")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith("export error: no training named 'nope'")


def test_the_rollout_page_links_the_same_records(images, processor, tiny_vl_model_dir, tmp_path):
    """Over real HTTP: the page's one export link answers the CLI's records for that rollout."""
    ep, _ = stored(images, processor, uuid="r-page")
    other, _ = stored(images, processor, uuid="r-other")
    db = tmp_path / "monitor.db"
    record_in(db, [ep, other], cfg=config(tiny_vl_model_dir, "mai-ui"))
    export_training(db, RUN, tmp_path / "out", progress=print)
    cli = [r for r in load(tmp_path / "out")[1] if r["rollout_uuid"] == "r-page"]
    store = MonitorStore(db)
    store.ingest(rollout_batch("r-bare"))  # a rollout with no stored episode
    rid = store.read.find_id("rollout", "r-page")
    bare = store.read.find_id("rollout", "r-bare")
    with ThreadedServer(create_app(store), name="monitor") as server, httpx.Client() as http:
        page = http.get(f"{server.url}/rollouts/{rid}").text
        links = re.findall(r'href="([^"]*examples\.parquet)"', page)
        assert links == [f"/rollouts/{rid}/examples.parquet"]
        got = http.get(f"{server.url}{links[0]}")
        assert got.status_code == 200 and got.headers["content-type"].endswith("parquet")
        assert "not stored" in http.get(f"{server.url}/rollouts/{bare}").text
        missing = http.get(f"{server.url}/rollouts/{bare}/examples.parquet")
        assert missing.status_code == 404 and "has no stored episode" in missing.text
    store.close()
    from datasets import Image, List, load_dataset

    (tmp_path / "linked.parquet").write_bytes(got.content)
    linked = load_dataset("parquet", data_files=str(tmp_path / "linked.parquet"), split="train")
    assert linked.features["images"] == List(Image())  # the export's features travel with it
    _same_records(list(linked.cast_column("images", List(Image(decode=False)))), cli)
