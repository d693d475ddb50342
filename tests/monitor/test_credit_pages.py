"""Step credit on the dashboard, in a real headless Chromium: the training page's step-group
curves and each turn's step advantage and state key on the rollout page.

A monitor of its own holds a training whose steps carry the rollout scope's ``cua/credit/...``
statistics as AReaL exports them, and a rollout whose turns got the group filter's step credit
updates in the shape the rollout worker sends (``cua_rl.credit.advantages.turn_notes`` of a
hand-built group): A and B pass one state, A succeeds; B's second step is a false merge. Page
screenshots go to the test's temp dir (``pytest -s`` prints their paths).
"""

from __future__ import annotations

import json

import httpx
import pytest

from cua_rl.credit.advantages import step_credit, turn_notes
from cua_rl.credit.config import StepCreditConfig
from cua_rl.credit.keys import StateKey
from cua_rl.credit.steps import EpisodeSteps, Step

from .conftest import MonitorProcess
from .test_dashboard_browser import _login

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NAME, TASK = "credit-run", "credit-task"
# Per step: share of steps in step groups of 2+, mean and largest step group size, false merges.
CURVES = {1: (0.25, 1.5, 3.0, 0.0), 2: (0.5, 2.0, 5.0, 1.0), 3: (0.75, 3.0, 9.0, 0.5)}


def _episode(eid: int, uuid: str, path: list[str], action: str) -> EpisodeSteps:
    return EpisodeSteps(
        eid,
        tuple(
            Step(i + 1, StateKey("gym", path[i]), action, StateKey("gym", path[i + 1]), (i,))
            for i in range(len(path) - 1)
        ),
        (),
        uuid,
    )


def _batch(with_credit: bool) -> tuple[dict, list[dict]]:
    name = NAME if with_credit else "plain-run"
    steps = []
    for n, (grouped, mean, largest, merges) in CURVES.items():
        metrics = {"rollout/cua/success": 0.5}
        if with_credit:
            metrics |= {
                "rollout/cua/credit/grouped_share": grouped,
                "rollout/cua/credit/step_group_size": mean,
                "rollout/cua/credit/step_group_size_max": largest,
                "rollout/cua/credit/false_merges": merges,
            }
        steps.append({"client_id": f"step-{name}-{n}-0", "training_client_id": name, "step": n,
                      "batch": 0, "status": "completed", "metrics_json": metrics})  # fmt: skip
    # A: p1 -> p2 -> done, success; B: p1 -> p2 -> erased, failure. Same action on p2 from both
    # with two outcomes: a false merge (as a key that joined two states would show).
    a = _episode(1, f"{name}-a", ["p1", "p2", "done"], "tap")
    b = _episode(2, f"{name}-b", ["p1", "p2", "erased"], "tap")
    credit = step_credit([a, b], [1.0, 0.0], StepCreditConfig(enabled=True))
    notes = turn_notes([a, b], credit, 1.0)
    batch = {
        "training": {"client_id": name, "run_name": name, "log_path": "l", "model_name": "m",
                     "status": "completed"},
        "tasks": [{"client_id": TASK, "task_id": TASK, "name": "credit task", "description": "d"}],
        "steps": steps,
        "rollouts": [{"client_id": u, "rollout_id": u, "step_client_id": f"step-{name}-1-0",
                      "task_client_id": TASK, "model_path": "m", "status": "completed",
                      "reward": r, "num_turns": 2} for u, r in ((f"{name}-a", 1.0),
                                                               (f"{name}-b", 0.0))],
        "turns": [{"client_id": f"{u}:turn:{n}", "rollout_client_id": u, "turn": n,
                   "model_response": f"reply {n}", "metrics_json": {"trained": True}}
                  for u in (f"{name}-a", f"{name}-b") for n in (1, 2)],
    }  # fmt: skip
    return batch, notes


@pytest.fixture
def server(tmp_path):
    proc = MonitorProcess(tmp_path / "credit.db", token="credit-token")
    proc.start()
    ids = {}
    for with_credit in (True, False):
        batch, notes = _batch(with_credit)
        resp = httpx.post(
            f"{proc.base_url}/api/ingest/batch", json=batch, headers=proc.headers(), timeout=30
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        ids[with_credit] = (
            body["training_id"],
            {r["client_id"]: r["id"] for r in body["rollouts"]},
        )
        if with_credit:
            # The filter's updates come later, in a batch of their own (the turns exist by then).
            resp = httpx.post(f"{proc.base_url}/api/ingest/batch", json={"turns": notes},
                              headers=proc.headers(), timeout=30)  # fmt: skip
            assert resp.status_code == 200, resp.text
    proc.ids = ids
    yield proc
    proc.stop()


def test_the_step_group_curves_and_each_turns_step_credit(server, browser, tmp_path):
    _login(browser, server.base_url, server.token)
    page = browser.page
    training, rollouts = server.ids[True]
    page.goto(f"{server.base_url}/trainings/{training}")
    page.wait_for_load_state("networkidle")
    for chart in ("credit_grouped", "credit_groups"):
        assert page.locator(f"#chart-{chart} canvas").count() == 1, chart
    charts = {c["id"]: c for c in json.loads(page.inner_text("#chart-data"))}
    grouped = dict(charts["credit_grouped"]["series"])
    assert grouped["grouped"] == [v[0] for v in CURVES.values()]
    sizes = dict(charts["credit_groups"]["series"])
    assert sizes["mean size"] == [v[1] for v in CURVES.values()]
    assert sizes["largest"] == [v[2] for v in CURVES.values()]
    assert sizes["false merges"] == [v[3] for v in CURVES.values()]
    shot = tmp_path / "training-credit.png"
    page.locator("#chart-credit_grouped").scroll_into_view_if_needed()
    page.screenshot(path=str(shot), full_page=True)
    print("page screenshot:", shot)

    # Rollout B (the failure): each turn's step advantage (its return 0 minus its step group's
    # mean 0.5), its state key and group; step 2 flagged as a false merge.
    page.goto(f"{server.base_url}/rollouts/{rollouts[f'{NAME}-b']}")
    page.wait_for_load_state("networkidle")
    credit = page.locator(".turn .step-credit")
    assert credit.count() == 2
    texts = [credit.nth(i).inner_text() for i in range(2)]
    assert "-0.500" in texts[0] and "gym:p1" in texts[0] and "step group of 2" in texts[0]
    assert "-0.500" in texts[1] and "gym:p2" in texts[1]
    assert page.locator(".turn .pill.false-merge").count() == 1
    colour = page.locator(".step-adv").first.evaluate("e => getComputedStyle(e).color")
    assert colour == "rgb(197, 34, 31)", colour  # negative: the page's red
    shot = tmp_path / "rollout-credit.png"
    page.screenshot(path=str(shot), full_page=True)
    print("page screenshot:", shot)
    page.goto(f"{server.base_url}/rollouts/{rollouts[f'{NAME}-a']}")
    page.wait_for_load_state("networkidle")
    assert "+0.500" in page.locator(".turn .step-credit").first.inner_text()
    assert browser.problems == []


def test_a_training_without_step_credit_has_no_step_group_curves(server, browser):
    _login(browser, server.base_url, server.token)
    page = browser.page
    training, rollouts = server.ids[False]
    page.goto(f"{server.base_url}/trainings/{training}")
    page.wait_for_load_state("networkidle")
    assert page.locator("#chart-success canvas").count() == 1
    assert page.locator("#chart-credit_grouped").count() == 0
    page.goto(f"{server.base_url}/rollouts/{rollouts['plain-run-a']}")
    page.wait_for_load_state("networkidle")
    assert page.locator(".step-credit").count() == 0
    assert browser.problems == []
