"""The export proven by the libraries that consume it, on real local trainings.

One training per context policy of the local agent (the full conversation, MAI-UI's window, the
current screenshot only): ``make demo``'s launcher, real asynchronous PPO steps with every episode
stored (``monitor.store_episodes=all``), the session's shared trainings that
tests/app/test_context_train.py checks (``shared_training``, tests/conftest.py ``REGIMES``). Each export loads with
``datasets.load_from_disk``; the tiny model's processor and a forward pass take every example (an
example whose images do not match its placeholders fails there: "Image features and image tokens
do not match", as MAI-UI's records did when the export wrote one record per episode with the
episode's other images appended); TRL's ``SFTTrainer`` trains one step on it. Expected counts
come from what the workflow stored (``episode_store``: its rows per episode), never from the
export. The dashboard's rollout page, in a real headless Chromium, offers that rollout's examples
as one download: the same records.
"""

from __future__ import annotations

import shutil
import sqlite3

import pytest

from cua_rl.monitor.export import Filters, export_episodes
from tests.conftest import BUILTIN_MAI_UI, DEMO, SERVICE_CURRENT, db_rows
from tests.monitor.browser import Browser
from tests.monitor.conftest import MonitorProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# The shared trainings, one per context policy (every episode stored): the append-only
# conversation from the agent service (the demo's own run), the windowed agent from the built-in
# loop, the current-only one from the agent service.
RUNS = {"full": DEMO, "mai-ui": BUILTIN_MAI_UI, "current": SERVICE_CURRENT}


@pytest.fixture(scope="module", params=list(RUNS))
def trained(request, shared_training):
    """(the context policy, the run) of one real training with every episode stored."""
    run = shared_training(RUNS[request.param].name)
    assert run.returncode == 0, run.output[-6000:]
    return request.param, run


def _model(folder):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(folder))


def _exported(run, out):
    lines = []
    report = export_episodes(run.db, out, Filters(), progress=lines.append)
    print(*lines, sep="\n")
    return report, lines


def _forward_every_example(ds, model, processor, policy: str) -> None:
    import torch

    for ex in ds:
        holders = sum(p["type"] == "image" for m in ex["messages"] for p in m["content"])
        assert holders == len(ex["images"]), (ex["rollout_uuid"], ex["row"])
        text = processor.apply_chat_template(ex["messages"], tokenize=False)
        batch = processor(text=[text], images=ex["images"] or None, return_tensors="pt")
        with torch.no_grad():
            logits = model(**batch).logits
        assert torch.isfinite(logits).all()
        # The request through the processor is the trained row's prompt, token for token, up
        # to the row's first sampled token: all of it where the request holds no earlier reply
        # (MAI-UI's re-rendered history and the current-only list are the agent's text); an
        # append-only row holds its earlier replies as sampled, which a BPE tokenizer may cut
        # otherwise when it reads them back as text (the row's ids keep them exactly). A call
        # that sampled no token is a row of its prompt alone, and an empty assistant turn.
        mask = ex["loss_mask"]
        first = mask.index(1) if 1 in mask else len(mask)
        if policy != "full":
            assert first == ex["prompt_tokens"]
        assert batch["input_ids"][0, :first].tolist() == ex["input_ids"][:first]


def _one_sft_step(ds, model, processor, out) -> float:
    import torch
    from trl import SFTConfig, SFTTrainer

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = SFTConfig(
        output_dir=str(out),
        max_steps=1,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        max_length=None,
        dataloader_num_workers=0,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=processor)
    result = trainer.train()
    assert trainer.state.global_step == 1
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "one optimizer step changed no weight"
    return result.training_loss


def test_every_example_goes_through_the_processor_a_forward_pass_and_trl(
    trained, tiny_vl_bpe_model_dir, tmp_path
):
    """The demo's model (the BPE tiny Qwen2-VL) and its processor take every example."""
    import math

    from datasets import load_from_disk
    from transformers import AutoProcessor

    policy, run = trained
    stored = db_rows(run.db, "SELECT n_rows FROM episode_store")
    assert stored, "the training stored its episodes"
    report, lines = _exported(run, tmp_path / "out")
    # One example per trained row: one per episode for the append-only conversation, one per
    # call for the agents that rebuild their request.
    assert report.episodes == len(stored)
    assert report.examples == sum(n for (n,) in stored)
    if policy == "full":
        assert {n for (n,) in stored} == {1}
    else:
        assert report.examples > report.episodes
    assert any(line.startswith("export: wrote") for line in lines)
    ds = load_from_disk(str(tmp_path / "out"))
    assert len(ds) == report.examples and set(ds["context"]) == {policy}
    processor = AutoProcessor.from_pretrained(str(tiny_vl_bpe_model_dir))
    _forward_every_example(ds, _model(tiny_vl_bpe_model_dir), processor, policy)
    loss = _one_sft_step(ds, _model(tiny_vl_bpe_model_dir), processor, tmp_path / "sft")
    assert math.isfinite(loss) and loss > 0


def test_the_rollout_page_offers_that_rollouts_examples(trained, tmp_path):
    from datasets import Image, List, load_dataset, load_from_disk

    policy, run = trained
    where = tmp_path / "served"
    where.mkdir()
    src, dst = sqlite3.connect(run.db), sqlite3.connect(where / "monitor.db")
    try:
        src.backup(dst)  # what the WAL holds too
    finally:
        src.close()
        dst.close()
    shutil.copytree(run.run_dir / "monitor.screenshots", where / "monitor.screenshots")
    rollout, uuid, n_rows = db_rows(
        run.db,
        "SELECT r.id, r.rollout_id, es.n_rows FROM episode_store es "
        "JOIN rollout r ON r.id = es.rollout_id ORDER BY es.n_rows DESC, es.id LIMIT 1",
    )[0]
    _exported(run, tmp_path / "cli")
    undecoded = List(Image(decode=False))
    cli = load_from_disk(str(tmp_path / "cli")).cast_column("images", undecoded)
    cli = sorted((r for r in cli if r["rollout_uuid"] == uuid), key=lambda r: r["row"])
    assert len(cli) == n_rows
    served = MonitorProcess(where / "monitor.db", token="export-token")
    served.start()
    browser = Browser(tmp_path / "profile")
    try:
        page = browser.page
        page.goto(f"{served.base_url}/login")
        page.fill("#token", served.token)
        with page.expect_navigation():
            page.click("button[type=submit]")
        page.goto(f"{served.base_url}/rollouts/{rollout}")
        page.wait_for_load_state("networkidle")
        link = page.locator("#export-examples")
        assert link.count() == 1
        assert link.inner_text() == f"{n_rows} example{'s' if n_rows != 1 else ''} (Parquet)"
        shot = tmp_path / f"rollout-{policy}.png"
        page.screenshot(path=str(shot), full_page=False)
        print("rollout page:", shot)
        with page.expect_download() as download:
            link.click()
        saved = tmp_path / "linked.parquet"
        download.value.save_as(str(saved))
        assert browser.problems == []
    finally:
        browser.close()
        served.stop()
    linked = load_dataset("parquet", data_files=str(saved), split="train")
    linked = sorted(linked.cast_column("images", undecoded), key=lambda r: r["row"])
    assert len(linked) == len(cli)
    for a, b in zip(linked, cli, strict=True):
        assert a == b
