"""The dashboard's rough edges a first day met, each looked at in a real headless Chromium
(Debian's, through Playwright) on records the product's own recorder sent over HTTP:

- the validation box read ``PASSED completed`` / ``PASSED failed``: now its verdict;
- a step's grid headed "sample 1..4" for groups of 2 (an asynchronous step also starts the next
  batch's groups): now group 1, group 2, each of 2 samples;
- a finished eval showed the phase it ended in (``aggregation``): now its status;
- a grid whose rewards were all equal showed them yellow, the scale's middle, under a red to
  green legend: now one neutral colour, the legend saying every reward is the same;
- the model column cut a long path at its start (``t/i55/.cache/...``): now the folder's name,
  the full path on hover and on the training's page;
- timestamps came to the microsecond, the millisecond or ISO with a T: now one form, UTC;
- the gym's answer to an action (``nothing to tap at (180, 320)``) was not shown;
- a MAI-UI turn showed one screenshot where the model received three.

Page screenshots are saved under the test's temp dir (``pytest -s`` prints their paths).
"""

from __future__ import annotations

import asyncio
import base64
import io
import re

import httpx
import pytest
from PIL import Image

from cua_rl.monitor.worker.client import MonitorClient, MonitorClientConfig
from cua_rl.monitor.worker.context import MonitorContext
from cua_rl.monitor.worker.recorder import RolloutRecorder
from cua_rl.trajectory.events import Turn

from .browser import login as _login
from .conftest import MonitorProcess, uid

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "/storage/models/checkpoints/run-2026-11-27/qwen3-vl-8b-instruct-sft-step-1200"
WHEN = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d$")


def _png(colour: tuple[int, int, int]) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (360, 640), colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


SHOTS = [_png((200, 40, 40)), _png((40, 160, 40)), _png((40, 40, 200))]


def _turns() -> list[Turn]:
    """Three MAI-UI turns: each request holds the screenshots so far (at most three), and the
    gym refused the second turn's tap."""
    answers = [
        {"ok": True, "error": None},
        {"ok": False, "error": "nothing to tap at (180, 320)", "status": 400},
        {"ok": True, "error": None, "screen": "home"},
    ]
    return [
        Turn(
            step=n + 1, index=n, prompt_ids=[1, 2, 3], output_ids=[7, 8], output_logprobs=[-0.5, -1.5],
            finish_reason="stop", image_urls=SHOTS[: n + 1], messages=None,
            text=f"tap(180, {320 + n})",
            actions=[{"name": "tap", "args": {"point": {"x": 180, "y": 320 + n}},
                      "rawResult": answers[n]}],
        )
        for n in range(3)
    ]  # fmt: skip


async def _record(server: MonitorProcess) -> dict[str, str]:
    config = MonitorClientConfig(
        base_url=server.base_url, token=server.token, flush_interval_s=0.05
    )
    client = MonitorClient(config, client=httpx.AsyncClient(timeout=30))
    await client.start()
    run = uid("edges-")
    client.training(
        run, log_path="l", model_name=MODEL, status="running", group_size=2, batch_size=2,
        config_json={"gconfig": {"n_samples": 2}, "eval_gconfig": {"n_samples": 2}},
    )  # fmt: skip
    step = client.step(run, 1, status="completed", current_phase="completed")
    ev = client.eval(run, 1, model_path=MODEL, status="completed", current_phase="aggregation")
    uuids = {}
    # Step 1 of an asynchronous run: two tasks, each with two groups of 2, every reward -0.4.
    for t in range(2):
        for k in range(4):
            uuid = uid(f"r{t}{k}-")
            recorder = RolloutRecorder(
                client, uuid, task_id=f"task-{t}", model_path=MODEL,
                source=MonitorContext(training_id=run, step_id=step),
                task={"name": f"task {t}", "description": "d"},
            )  # fmt: skip
            await recorder.start()
            if (t, k) == (0, 0):
                await recorder.record_turns(_turns())
                await recorder.validation(success=False, actual_result="wifi still off")
                uuids["mai_ui"] = uuid
            await recorder.complete(reward=-0.4)
    for k in range(2):
        recorder = RolloutRecorder(
            client, uid("e-"), task_id="task-0", model_path=MODEL,
            source=MonitorContext(training_id=run, eval_id=ev), task={"name": "task 0"},
        )  # fmt: skip
        await recorder.start()
        await recorder.complete(reward=[0.0, 1.0][k])
    assert await client.flush(timeout=30)
    assert client.counters.dropped == 0, client.counters
    await client.close(timeout=5)
    return {"run": run, **uuids}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    proc = MonitorProcess(tmp_path_factory.mktemp("edges") / "edges.db", token="edges-token")
    proc.start()
    yield proc
    proc.stop()


def _ids(server: MonitorProcess, names: dict[str, str]) -> dict[str, int]:
    with httpx.Client(base_url=server.base_url, headers=server.headers(), timeout=30) as http:
        (training,) = [
            t
            for t in http.get("/api/trainings").json()["trainings"]
            if t["run_name"] == names["run"]
        ]
        detail = http.get(f"/api/trainings/{training['id']}").json()["training"]
        step = detail["steps"][0]["id"]
        rollouts = http.get(f"/api/steps/{step}/rollouts").json()["rollouts"]
    mai_ui = next(r["id"] for r in rollouts if r["rollout_id"] == names["mai_ui"])
    return {
        "training": training["id"],
        "step": step,
        "eval": detail["evals"][0]["id"],
        "rollout": mai_ui,
    }


@pytest.fixture(scope="module")
def recorded(served) -> dict[str, int]:
    # Before the browser starts: Playwright's sync API holds the thread's event loop.
    return _ids(served, asyncio.run(_record(served)))


def test_the_rough_edges_in_chromium(served, recorded, browser, tmp_path):
    ids = recorded
    _login(browser, served.base_url, served.token)
    page = browser.page
    saved = []

    def visit(path: str, name: str) -> None:
        page.goto(served.base_url + path)
        page.wait_for_load_state("networkidle")
        for img in page.locator("img").all():
            img.scroll_into_view_if_needed()
            page.wait_for_function(
                "i => i.complete && i.naturalWidth > 0", arg=img.element_handle(), timeout=30_000
            )
        shot = tmp_path / f"{name}.png"
        page.screenshot(path=str(shot), full_page=True)
        saved.append(shot)

    def fact(label: str) -> str:
        return page.eval_on_selector_all(
            ".facts > div",
            "(els, label) => els.filter(e => e.querySelector('b')?.textContent.trim()"
            " === label).map(e => e.textContent.replace(e.querySelector('b').textContent, '')"
            ".trim())",
            label,
        )

    # The trainings list: the model's folder name, its full path on hover.
    visit("/", "trainings")
    cell = page.locator("tr.training-row td.model")
    assert cell.inner_text() == MODEL.rsplit("/", 1)[1]
    assert cell.get_attribute("title") == MODEL

    # The training's page: the full path, not cut; timestamps in one form.
    visit(f"/trainings/{ids['training']}", "training")
    assert fact("model") == [MODEL]

    # The step: groups of 2, every reward equal.
    visit(f"/steps/{ids['step']}", "step")
    heads = page.eval_on_selector_all(".grid th", "els => els.map(e => e.textContent.trim())")
    assert heads == ["task", "group 1", "group 2", *["sample 1", "sample 2"] * 2], heads
    colours = page.eval_on_selector_all(
        ".grid a.sample", "els => els.map(e => getComputedStyle(e).backgroundColor)"
    )
    assert len(colours) == 8 and len(set(colours)) == 1, colours
    assert colours[0] != "rgb(230, 230, 138)"  # not the scale's yellow middle
    assert "every reward is -0.4" in page.locator("#legend").inner_text()
    assert page.locator("#legend .swatch").count() == 0

    # The finished eval: its phase is its status; a reward range has its scale.
    visit(f"/evals/{ids['eval']}", "eval")
    assert fact("phase") == ["completed"]
    assert page.locator("#legend .swatch").count() == 1

    # The MAI-UI rollout: the window of screenshots, the gym's answers, the verdict.
    visit(f"/rollouts/{ids['rollout']}", "rollout")
    turns = page.eval_on_selector_all(
        ".turn",
        """els => els.map(e => ({
            received: e.querySelector('.context-shots')?.dataset.images ?? null,
            earlier: [...e.querySelectorAll('.context-shots img')]
                .filter(i => i.complete && i.naturalWidth > 0).length,
            results: [...e.querySelectorAll('.action-result')]
                .map(r => [r.className, r.textContent.trim()]),
        }))""",
    )
    assert [t["received"] for t in turns] == [None, "2", "3"], turns
    assert [t["earlier"] for t in turns] == [0, 1, 2], turns
    assert turns[1]["results"] == [
        ["action-result refused", "environment: nothing to tap at (180, 320)"]
    ]
    assert turns[0]["results"] == [["action-result done", "environment: done"]]
    assert page.locator(".verdict").inner_text() == "not passed"
    assert "PASSED" not in page.locator("#validation").inner_text().upper().replace(
        "NOT PASSED", ""
    )
    stamps = page.eval_on_selector_all(
        "table.history td:first-child", "els => els.map(e => e.textContent.trim())"
    )
    assert stamps and all(WHEN.match(s) for s in stamps), stamps
    assert WHEN.match(fact("at (UTC)")[0])
    print("page screenshots:", *saved, sep="\n  ")
    assert browser.problems == []
