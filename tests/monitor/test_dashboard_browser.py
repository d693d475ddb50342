"""The dashboard in a real headless Chromium (Debian's package, driven by Playwright's Python API)
on the database and screenshots written by a real local run (the session's ``demo_run``).

Every page is loaded after logging in through the form; a page passes with no console error and
no failed request. Page screenshots are saved under the test's temp dir (their paths are printed:
``pytest -s`` shows them).
"""

from __future__ import annotations

import shutil
import sqlite3
import time

import httpx
import pytest

from tests.conftest import db_rows

from .browser import login as _login
from .conftest import MonitorProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def served(demo_run, tmp_path_factory):
    """A copy of the demo's database and screenshots, served with a token."""
    assert demo_run.returncode == 0, demo_run.output[-3000:]
    where = tmp_path_factory.mktemp("served")
    shutil.copy(demo_run.db, where / "monitor.db")
    shutil.copytree(demo_run.run_dir / "monitor.screenshots", where / "monitor.screenshots")
    proc = MonitorProcess(where / "monitor.db", token="browser-token")
    proc.start()
    yield proc
    proc.stop()


def _ids(db, sql: str) -> list[int]:
    con = sqlite3.connect(db)
    try:
        return [r[0] for r in con.execute(sql)]
    finally:
        con.close()


def test_every_page_loads_cleanly_with_curves_screenshots_and_drawn_actions(
    served, browser, tmp_path
):
    base, db = served.base_url, served.db
    _login(browser, base, served.token)
    page = browser.page
    training = _ids(db, "SELECT id FROM training")[0]
    steps = _ids(db, "SELECT id FROM step ORDER BY step")
    evals = _ids(db, "SELECT id FROM eval")
    baselines = _ids(db, "SELECT id FROM baseline")
    rollouts = _ids(db, "SELECT id FROM rollout ORDER BY id")
    paths = ["/", f"/trainings/{training}"]
    paths += [f"/steps/{i}" for i in steps] + [f"/evals/{i}" for i in evals]
    paths += [f"/baselines/{i}" for i in baselines] + [f"/rollouts/{i}" for i in rollouts]
    saved = []
    for n, path in enumerate(paths):
        before = len(browser.problems)
        # The page's load (its stylesheets, scripts and eager images; the charts are drawn
        # before it), not "networkidle": twice in fresh clones under the suite's load a page
        # never went 500 ms without a request (30 s, then 180 s). Lazy screenshots are waited
        # for one by one (_check_rollout_turns).
        page.goto(base + path, wait_until="load")
        assert page.title().endswith("cua-rl monitor"), path
        assert browser.problems[before:] == [], path
        if path == f"/trainings/{training}":
            charts = page.eval_on_selector_all(
                ".chart",
                "els => els.map(e => [e.id, e.dataset.points, !!e.querySelector('canvas')])",
            )
            assert len(charts) >= 8
            # One point per recorded step in every curve, each drawn on a canvas.
            assert all(points == str(len(steps)) and drawn for _, points, drawn in charts), charts
            assert page.locator("tr.step-row").count() == len(steps)
        if path.startswith("/rollouts/"):
            _check_rollout_turns(page, db, int(path.rsplit("/", 1)[1]))
        if n < 3 or path in (f"/steps/{steps[0]}", f"/rollouts/{rollouts[-1]}"):
            shot = tmp_path / f"page-{n:02d}-{path.strip('/').replace('/', '-') or 'trainings'}.png"
            page.screenshot(path=str(shot), full_page=True)
            saved.append(shot)
    print("page screenshots:", *saved, sep="\n  ")
    assert browser.problems == []


def _check_rollout_turns(page, db, rollout_id: int) -> None:
    """Each turn shows the screenshot the model saw (loaded from the store) and its action.

    A rollout the run's end cancelled may hold a turn without its screenshot: the workflow
    records an episode's turns one by one after the agent run (``RolloutRecorder.record_turns``:
    the turn, its actions, then its screenshot), and the drain's cancel can cut that between a
    turn's records and its screenshot. Its card says so instead."""
    turns = db_rows(
        db,
        "SELECT t.id, EXISTS (SELECT 1 FROM obs o WHERE o.turn_id = t.id AND o.screenshot_uri "
        "IS NOT NULL) FROM turn t WHERE t.rollout_id = ? ORDER BY t.turn",
        rollout_id,
    )
    status = db_rows(db, "SELECT status FROM rollout WHERE id = ?", rollout_id)[0][0]
    # Screenshots load lazily (a long rollout would fetch every one up front): bring each into
    # view and wait (bounded) until it has loaded before reading its state.
    shots = page.locator("img.screenshot")
    for i in range(shots.count()):
        shots.nth(i).scroll_into_view_if_needed()
        page.wait_for_function(
            "img => img.complete && img.naturalWidth > 0",
            arg=shots.nth(i).element_handle(),
            timeout=30_000,
        )
    cards = page.eval_on_selector_all(
        ".turn",
        """els => els.map(e => {
            const img = e.querySelector('img.screenshot');
            return {
                loaded: !!img && img.complete && img.naturalWidth > 0,
                drawn: e.querySelectorAll('svg .drawn-action').length,
                labels: e.querySelectorAll('.drawn-label').length,
                none: e.querySelector('.shot .none')?.textContent || null,
            };
        })""",
    )
    assert len(cards) == len(turns)
    for (_, has_shot), card in zip(turns, cards, strict=True):
        if not has_shot:
            assert status == "cancelled", (rollout_id, status, cards)
            assert card["none"] == "no screenshot recorded", (rollout_id, cards)
            continue
        assert card["loaded"], (rollout_id, cards)
        assert card["drawn"] >= 1 and card["labels"] >= 1, (rollout_id, cards)


def test_an_open_training_page_gains_a_new_step_without_a_reload(served, browser, tmp_path):
    base, db = served.base_url, served.db
    training = _ids(db, "SELECT id FROM training")[0]
    run_name = sqlite3.connect(db).execute("SELECT run_name FROM training").fetchone()[0]
    n_steps = len(_ids(db, "SELECT id FROM step"))
    post = httpx.Client(base_url=base, headers=served.headers(), timeout=30)
    # The run goes on: the training is running again (as during a real run).
    resp = post.post(
        "/api/ingest/batch",
        json={"training": {"client_id": run_name, "run_name": run_name, "status": "running"}},
    )
    assert resp.status_code == 200, resp.text
    _login(browser, base, served.token)
    page = browser.page
    page.goto(f"{base}/trainings/{training}")
    page.wait_for_load_state("networkidle")
    page.evaluate("window.__notReloaded = true")
    new_step = n_steps + 1
    resp = post.post(
        "/api/ingest/batch",
        json={
            "steps": [
                {
                    "client_id": f"step-{run_name}-{new_step}-0",
                    "training_client_id": run_name,
                    "step": new_step,
                    "batch": 0,
                    "status": "completed",
                    "reward_mean": 0.75,
                    "reward_std": 0.05,
                }
            ]
        },
    )
    assert resp.status_code == 200, resp.text
    t0 = time.monotonic()
    page.wait_for_selector(f'tr.step-row[data-step="{new_step}"]')
    page.wait_for_function(
        f"document.getElementById('chart-reward').dataset.points === '{new_step}'"
    )
    assert page.evaluate("window.__notReloaded") is True
    print(f"new step shown {time.monotonic() - t0:.1f}s after it was recorded")
    page.screenshot(path=str(tmp_path / "training-live.png"), full_page=True)
    post.close()
    assert browser.problems == []


def test_without_the_token_the_browser_gets_the_login_page(served, browser, tmp_path):
    page = browser.page
    training = _ids(served.db, "SELECT id FROM training")[0]
    page.goto(f"{served.base_url}/trainings/{training}")
    assert "/login" in page.url and page.locator("#token").count() == 1
    page.fill("#token", "wrong-token")
    page.click("button[type=submit]")
    page.wait_for_selector("#login-error")
    assert page.inner_text("#login-error") == "wrong token"
    page.screenshot(path=str(tmp_path / "login.png"))
    sha = _ids(served.db, "SELECT rowid FROM screenshot")
    assert sha, "the run stored no screenshot"
    digest = sqlite3.connect(served.db).execute("SELECT sha256 FROM screenshot").fetchone()[0]
    resp = page.request.get(f"{served.base_url}/api/screenshots/{digest}")
    assert resp.status == 401


@pytest.fixture
def rows_server(tmp_path):
    """A monitor of its own (no demo run needed) holding one rollout whose rows dropped tokens:
    one turn trained, one not."""
    proc = MonitorProcess(tmp_path / "rows.db", token="rows-token")
    proc.start()
    name, task, uuid = "rows-run", "rows-task", "rows-rollout"
    step = f"step-{name}-1-0"
    conversion = {"rows": 1, "trained_turns": 1, "dropped_turns": 1, "sampled_tokens": 147,
                  "trained_tokens": 90, "turns": 2}  # fmt: skip
    batch = {
        "training": {"client_id": name, "run_name": name, "log_path": "l", "model_name": "m",
                     "status": "completed"},
        "tasks": [{"client_id": task, "task_id": task, "name": "rows task", "description": "d"}],
        "steps": [{"client_id": step, "training_client_id": name, "step": 1, "batch": 0,
                   "status": "completed",
                   "metrics_json": {"rollout/cua/rows": 1.0, "rollout/cua/sampled_tokens": 147.0,
                                    "rollout/cua/trained_tokens": 90.0}}],
        "rollouts": [{"client_id": uuid, "rollout_id": uuid, "step_client_id": step,
                      "task_client_id": task, "model_path": "m", "status": "completed",
                      "reward": 1.0, "num_turns": 2,
                      "metrics_json": {"conversion": conversion, "timings": {}}}],
        "turns": [
            {"client_id": f"{uuid}:turn:{n}", "rollout_client_id": uuid, "turn": n,
             "model_response": f"reply {n}", "metrics_json": {"trained": n == 1}}
            for n in (1, 2)
        ],
    }  # fmt: skip
    resp = httpx.post(
        f"{proc.base_url}/api/ingest/batch", json=batch, headers=proc.headers(), timeout=30
    )
    assert resp.status_code == 200, resp.text
    proc.rollout_id = resp.json()["rollouts"][0]["id"]
    proc.training_id = resp.json()["training_id"]
    yield proc
    proc.stop()


def test_a_rollout_page_shows_what_its_rows_trained(rows_server, browser, tmp_path):
    """Rows and tokens trained / sampled at the top, dropped tokens highlighted in red, and a
    pill per turn; the step's per-episode figures on the training page; no demo run needed."""
    _login(browser, rows_server.base_url, rows_server.token)
    page = browser.page
    page.goto(f"{rows_server.base_url}/rollouts/{rows_server.rollout_id}")
    page.wait_for_load_state("networkidle")
    assert page.inner_text("#rows-trained") == "1"
    fact = page.locator("#tokens-trained")
    assert "90 / 147" in fact.inner_text() and "57 tokens dropped" in fact.inner_text()
    # Highlighted as the stylesheet says: red text on a red-tinted background.
    colour = fact.evaluate("e => getComputedStyle(e).color")
    background = fact.evaluate("e => getComputedStyle(e).backgroundColor")
    assert colour == "rgb(197, 34, 31)" and background == "rgb(252, 232, 230)", (colour, background)
    pills = page.eval_on_selector_all(".turn .pill.trained, .turn .pill.not-trained",
                                      "els => els.map(e => e.textContent)")  # fmt: skip
    assert pills == ["trained", "not trained"]
    shot = tmp_path / "rollout-rows.png"
    page.screenshot(path=str(shot), full_page=True)
    print("page screenshot:", shot)
    # The training page: the step's per-episode tokens highlighted, the new curves drawn.
    page.goto(f"{rows_server.base_url}/trainings/{rows_server.training_id}")
    page.wait_for_load_state("networkidle")
    assert page.inner_text("td.ep-tokens.dropped") == "90 / 147"
    for chart in ("episode_tokens", "episode_rows"):
        assert page.locator(f"#chart-{chart} canvas").count() == 1, chart
    page.screenshot(path=str(tmp_path / "training-rows.png"), full_page=True)
    assert browser.problems == []
