"""The dashboard over real HTTP: who gets in, and what each page holds (the browser tests in
test_dashboard_browser.py look at the same pages in Chromium on a real run's database)."""

from __future__ import annotations

import html
import json
import re

import httpx
import pytest

from cua_rl.monitor.server.rollout_view import conversion_view
from cua_rl.monitor.server.views import EQUAL_REWARDS, action_overlay, reward_colour, token_view

from .conftest import MonitorProcess, uid

SESSION = "cua_monitor_session"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = MonitorProcess(tmp_path_factory.mktemp("dash") / "dash.db")
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def anon(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def run(server):
    """A training with three steps (rewards given by hand), a baseline, and one step's rollouts:
    two tasks x two samples, one of them rejected, one with turns and actions."""
    name = uid("dash-run-")
    tasks = [uid("task-a-"), uid("task-b-")]
    uuids = [uid("r-") for _ in range(4)]
    step = f"step-{name}-1-0"
    batch = {
        "training": {
            "client_id": name, "run_name": name, "log_path": "l", "model_name": "tiny-vl",
            "status": "running", "current_step": 3, "total_steps": 5, "current_phase": "rollout",
            "config_json": {"lr": 0.0001, "marker": "config-marker-7"},
        },
        "tasks": [
            {"client_id": t, "task_id": t, "name": f"name of {t}", "description": "d"} for t in tasks
        ],
        "steps": [
            {"client_id": f"step-{name}-{n}-0", "training_client_id": name, "step": n, "batch": 0,
             "status": "completed", "reward_mean": r, "reward_std": 0.1, "kl_divergence": 0.01 * n,
             "num_tokens": 100 * n, "metrics_json": {"rollout/cua/success": s,
                                                   "ppo_actor/update/entropy/avg": 5.0 - n}}
            for n, r, s in ((1, -0.25, 0.0), (2, 0.125, 0.5), (3, 0.5, 1.0))
        ],
        "baselines": [{"client_id": f"baseline-{name}-0", "training_client_id": name,
                       "model_path": "m", "status": "completed", "success_rate": 0.25}],
        "rollouts": [
            {"client_id": u, "rollout_id": u, "step_client_id": step, "task_client_id": tasks[i // 2],
             "model_path": "m", "status": "completed", "reward": [0.0, 1.0, 0.5, 0.0][i],
             "num_turns": 2}
            for i, u in enumerate(uuids[:3])
        ] + [
            {"client_id": uuids[3], "rollout_id": uuids[3], "step_client_id": step,
             "task_client_id": tasks[1], "model_path": "m", "status": "failed",
             "status_message": "missing_tokens", "error_message": "turn 2 lack token data"}
        ],
        "turns": [
            {"client_id": f"{uuids[1]}:turn:1", "rollout_client_id": uuids[1], "turn": 1,
             "model_response": "tap(120, 300)"},
            {"client_id": f"{uuids[1]}:turn:2", "rollout_client_id": uuids[1], "turn": 2,
             "model_response": 'type("hello")'},
        ],
        "actions": [
            {"client_id": f"{uuids[1]}:turn:1:action:0", "turn_client_id": f"{uuids[1]}:turn:1",
             "tool_name": "tap", "tool_args": {"point": {"x": 120, "y": 300}},
             "tokens": [11, 12, 13, 14, 15], "logprobs": [-0.1, -4.0, -0.2, -3.0, -2.0]},
            {"client_id": f"{uuids[1]}:turn:2:action:0", "turn_client_id": f"{uuids[1]}:turn:2",
             "tool_name": "type", "tool_args": {"content": "hello"}},
        ],
        "observations": [
            {"client_id": f"{uuids[1]}:turn:1:obs:0", "turn_client_id": f"{uuids[1]}:turn:1",
             "obs_type": "screenshot", "screenshot_uri": "sha256:" + "ab" * 32,
             "source_width": 360, "source_height": 640},
        ],
    }  # fmt: skip
    resp = httpx.post(
        f"{server.base_url}/api/ingest/batch", json=batch, headers=server.headers(), timeout=30
    )
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    return {
        "name": name,
        "training_id": answer["training_id"],
        "step_id": answer["steps"][0]["id"],
        "baseline_id": answer["baselines"][0]["id"],
        "rollouts": [r["id"] for r in answer["rollouts"]],
        "tasks": tasks,
    }


@pytest.fixture
def user(server):
    """A browser-like client that logged in with the token."""
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        resp = client.post("/login", data={"token": server.token, "next": "/"})
        assert resp.status_code == 303, resp.text
        yield client


# ---------------------------------------------------------------------------- auth


def test_without_the_token_pages_lead_to_login_and_reads_are_401(anon, server, run):
    for path in ("/", f"/trainings/{run['training_id']}", f"/rollouts/{run['rollouts'][0]}"):
        resp = anon.get(path)
        assert resp.status_code == 303, (path, resp.status_code)
        assert resp.headers["location"].startswith("/login?next=")
    login = anon.get("/login")
    assert login.status_code == 200 and 'name="token"' in login.text
    assert run["name"] not in login.text
    assert anon.get("/api/trainings").status_code == 401
    assert anon.get(f"/api/rollouts/{run['rollouts'][0]}").status_code == 401
    assert anon.get("/api/screenshots/" + "ab" * 32).status_code == 401
    assert anon.get("/static/dashboard.js").status_code == 303
    # A script's live poll gets an answer, not a redirect.
    assert anon.get("/", headers={"X-Live": "1"}).status_code == 401


def test_a_wrong_token_is_refused(anon, server, run):
    resp = anon.post("/login", data={"token": "not-the-token", "next": "/trainings/7"})
    assert resp.status_code == 401 and "wrong token" in resp.text
    # The form asks again and still leads where the user was going.
    assert 'name="next" value="/trainings/7"' in resp.text
    assert SESSION not in resp.cookies
    bad = {"Authorization": "Bearer not-the-token"}
    assert anon.get("/", headers=bad).status_code == 401
    assert anon.get("/api/trainings", headers=bad).status_code == 401
    forged = anon.get("/", cookies={SESSION: "0" * 64})
    assert forged.status_code == 303


def test_login_sets_an_httponly_session_that_reads_but_never_writes(server, run):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        resp = client.post("/login", data={"token": server.token, "next": "//evil.example/x"})
        assert resp.status_code == 303
        assert resp.headers["location"] == "/"  # never to another site
        cookie = resp.headers["set-cookie"]
        assert cookie.startswith(f"{SESSION}=")
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
        assert server.token not in cookie
        assert client.get("/").status_code == 200
        assert client.get("/api/trainings").status_code == 200
        # Writes take the Bearer token only: a cookie cannot write from another site.
        assert client.post("/api/ingest/batch", json={}).status_code == 401
        out = client.post("/logout")
        assert out.status_code == 303
        assert client.get("/").status_code == 303


def test_bearer_token_also_opens_pages(anon, server, run):
    resp = anon.get(f"/trainings/{run['training_id']}", headers=server.headers())
    assert resp.status_code == 200
    assert re.match(r"render;dur=[0-9.]+", resp.headers["server-timing"])
    assert "script-src 'self'" in resp.headers["content-security-policy"]


# ---------------------------------------------------------------------------- pages


def test_trainings_page_lists_status_progress_steps_and_last_success(user, run):
    page = user.get("/").text
    row = next(r for r in page.split('<tr class="training-row">') if run["name"] in r)
    assert "running" in row and "rollout" in row
    assert "3 / 5" in row
    assert "100%" in row  # the last completed step's success (step 3: 1.0)
    # Recorded moments ago by the server: not stale.
    assert "stale" not in row


def test_training_page_has_a_row_and_a_point_per_step(user, run):
    page = user.get(f"/trainings/{run['training_id']}").text
    assert [int(s) for s in re.findall(r'class="step-row" data-step="(\d+)"', page)] == [1, 2, 3]
    points = re.findall(r'id="chart-(\w+)" data-points="(\d+)"', page)
    assert {name for name, _ in points} >= {"reward", "success", "kl", "entropy", "tokens"}
    assert all(n == "3" for _, n in points), points
    assert "config-marker-7" in page
    assert "missing_tokens" in page  # rejected by reason
    assert "25%" in page  # the baseline's success rate


def test_training_page_shows_the_service_pauses_open_and_ended(server, user):
    name = uid("paused-")
    pause = {"training_client_id": name, "service": "gym", "reason": "gym_error", "phase": "train"}
    batch = {
        "training": {"client_id": name, "run_name": name, "log_path": "l", "model_name": "m"},
        "pauses": [
            {**pause, "client_id": f"pause-{name}-a", "start_time": 1000.0, "end_time": 1042.5,
             "duration_s": 42.5, "probes": 5, "error_message": "gym create answered 500: boom"},
            {**pause, "client_id": f"pause-{name}-b", "service": "model_server",
             "reason": "gateway_model_server_error", "start_time": 2000.0, "probes": 1,
             "error_message": "ConnectError: refused"},
        ],
    }  # fmt: skip
    resp = httpx.post(
        f"{server.base_url}/api/ingest/batch", json=batch, headers=server.headers(), timeout=30
    )
    assert resp.status_code == 200, resp.text
    training_id = resp.json()["training_id"]
    page = user.get(f"/trainings/{training_id}").text
    rows = re.findall(r'<tr class="pause-row( open)?">(.*?)</tr>', page, flags=re.S)
    # Newest first: the open model-server pause, then the gym's, which ended after 42.5 s.
    assert [(bool(o), "model_server" in r, "gym_error" in r) for o, r in rows] == [
        (True, True, False),
        (False, False, True),
    ]
    assert ">paused<" in rows[0][1] and "ConnectError: refused" in rows[0][1]
    assert ">resumed<" in rows[1][1] and "answered 500: boom" in rows[1][1]
    assert re.search(r">\s*5\s*<", rows[1][1])  # its failed probes
    api = user.get(f"/api/trainings/{training_id}").json()["training"]
    assert [p["service"] for p in api["pauses"]] == ["gym", "model_server"]


def test_step_page_is_a_task_by_sample_grid(user, run):
    page = user.get(f"/steps/{run['step_id']}").text
    ids = [int(x) for x in re.findall(r'data-rollout="(\d+)"', page)]
    assert sorted(ids) == sorted(run["rollouts"])
    for task in run["tasks"]:
        assert f"name of {task}" in page
    assert "sample 2" in page and "sample 3" not in page
    assert "missing_tokens" in page
    assert user.get(f"/baselines/{run['baseline_id']}").status_code == 200


def test_rollout_page_shows_turns_actions_and_tokens(user, run):
    page = user.get(f"/rollouts/{run['rollouts'][1]}").text
    assert "tap(120, 300)" in page and "type: hello" in page
    assert "5 tokens" in page
    # The three least likely tokens (-4.0, -3.0, -2.0 -> ids 12, 14, 15) are marked.
    low = re.findall(r'<span class="tok low"[^>]*>(\d+)</span>', page)
    assert sorted(low) == ["12", "14", "15"]
    # The screenshot was never uploaded: no broken <img>, a note instead.
    assert "not in the store" in page and "<img" not in page


def test_unknown_ids_are_404(user):
    for path in ("/trainings/999999", "/steps/999999", "/rollouts/999999"):
        assert user.get(path).status_code == 404


# ---------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        ("tap", {"point": {"x": 10, "y": 20}}, {"kind": "tap", "x": 10.0, "y": 20.0}),
        ("tap", {"x": 5, "y": 6}, {"kind": "tap", "x": 5.0, "y": 6.0}),
        (
            "swipe",
            {"startPoint": {"x": 1, "y": 2}, "endPoint": {"x": 3, "y": 4}},
            {"kind": "swipe", "x": 1.0, "y": 2.0, "x2": 3.0, "y2": 4.0},
        ),
        ("swipe", {"x1": 1, "y1": 2, "x2": 3, "y2": 4}, {"kind": "swipe", "x2": 3.0}),
        ("type", {"content": "hi"}, {"kind": "label", "text": "type: hi"}),
        ("home", {}, {"kind": "label", "text": "home"}),
        ("tap", "not a dict", {"kind": "label", "text": "tap"}),
    ],
)
def test_action_overlay(name, args, expected):
    got = action_overlay(name, args)
    assert {k: got[k] for k in expected} == expected


def test_token_view_marks_the_least_likely_and_averages():
    view = token_view([{"tokens": "[1, 2, 3, 4]", "logprobs": "[-1.0, -0.5, -3.0, -2.5]"}])
    assert view["count"] == 4 and view["mean_logprob"] == pytest.approx(-1.75)
    assert [t["id"] for t in view["items"] if t["low"]] == [1, 3, 4]
    assert token_view([{"tokens": None}]) is None


def test_reward_colour_runs_from_red_to_green():
    assert reward_colour(0.0, 0.0, 1.0) == "hsl(0, 65%, 72%)"
    assert reward_colour(1.0, 0.0, 1.0) == "hsl(120, 65%, 72%)"
    # All equal: one neutral colour, not the scale's yellow middle (test_dashboard_edges.py).
    assert reward_colour(0.5, 0.5, 0.5) == EQUAL_REWARDS != "hsl(60, 65%, 72%)"


def test_episodes_stopped_by_the_end_of_a_run_are_not_rejections(store):
    """A cancelled episode (a prefetched batch no step trains, a stopped run) is counted
    stopped, apart from the rejected ones, and names no rejection reason."""
    from datetime import UTC, datetime

    from cua_rl.monitor.server.views import training_page

    name, step = uid("stopped-"), uid("step-")
    statuses = ("completed", "completed", "failed", "cancelled", "cancelled")
    store.ingest(
        {
            "training": {"client_id": name, "run_name": name, "log_path": "l",
                         "model_name": "m", "status": "completed"},
            "tasks": [{"client_id": "t", "task_id": "t", "name": "t", "description": "d"}],
            "steps": [{"client_id": step, "training_client_id": name, "step": 1,
                       "status": "completed"}],
            "rollouts": [
                {"client_id": f"{step}-{i}", "rollout_id": f"{step}-{i}",
                 "step_client_id": step, "task_client_id": "t", "model_path": "m",
                 "status": st, "status_message": "missing_tokens" if st == "failed" else None}
                for i, st in enumerate(statuses)
            ],
        }
    )  # fmt: skip
    training_id = store.find_id("training", name)
    page = training_page(store.read, training_id, now=datetime.now(UTC), stale_after_s=60)
    (row,) = page["steps"]
    assert (row["accepted"], row["rejected"], row["stopped"], row["running"]) == (2, 1, 2, 0)
    assert page["reasons"] == [("missing_tokens", 1)]
    episodes = next(c for c in page["charts"] if c["id"] == "episodes")
    assert dict(episodes["series"]) == {"accepted": [2], "rejected": [1], "stopped": [2]}


# ---------------------------------------------------------------------------- what the rows trained


def _conversion(**overrides) -> dict:
    """An episode's conversion stats as the workflow records them (``convert_turns``' keys)."""
    stats = {
        "rows": 2, "trained_turns": 3, "dropped_turns": 0, "sampled_tokens": 147,
        "trained_tokens": 147, "row_tokens": 910, "images": 3, "distinct_images": 3,
        "processed_images": 3, "prefix_breaks": 1, "segments": 2, "turns": 3,
    }  # fmt: skip
    return {**stats, **overrides}


def _rollout(uuid: str, step: str, task: str, **overrides) -> dict:
    record = {
        "client_id": uuid, "rollout_id": uuid, "step_client_id": step, "task_client_id": task,
        "model_path": "m", "status": "completed", "reward": 1.0, "num_turns": 2,
    }  # fmt: skip
    return {**record, **overrides}


def _turn(uuid: str, n: int, **overrides) -> dict:
    record = {"client_id": f"{uuid}:turn:{n}", "rollout_client_id": uuid, "turn": n,
              "model_response": f"reply {n}"}  # fmt: skip
    return {**record, **overrides}


def _step(name: str, n: int, **metrics) -> dict:
    return {"client_id": f"step-{name}-{n}-0", "training_client_id": name, "step": n,
            "batch": 0, "status": "completed", "reward_mean": 0.5, "metrics_json": metrics}  # fmt: skip


def _facts(page: str) -> tuple[str, str, bool]:
    """The rollout page's "rows trained" and "tokens trained / sampled" facts as shown, and
    whether the tokens fact is highlighted."""
    rows = re.search(r'<span id="rows-trained">([^<]*)</span>', page).group(1)
    tokens = re.search(r'<div id="tokens-trained"([^>]*)><b>[^<]*</b>([^<]*)', page)
    return rows, tokens.group(2), 'class="dropped"' in tokens.group(1)


def _pills(page: str) -> list[str | None]:
    """Per turn card: its trained pill ("trained", "not trained") or None."""
    cards = page.split('class="turn card"')[1:]
    found = [
        re.search(r'<span class="pill (?:not-)?trained"[^>]*>([^<]*)</span>', c) for c in cards
    ]
    return [m.group(1) if m else None for m in found]


@pytest.fixture(scope="module")
def trained(server):
    """Rollouts whose rows trained every token, rollouts that dropped some, an old rollout
    recorded before conversion stats existed and a rejected one; steps with and without the
    per-episode row stats."""
    name, task = uid("rows-run-"), uid("rows-task-")
    step = f"step-{name}-1-0"
    all_, dropped, old, rejected = (uid(f"{k}-") for k in ("all", "dropped", "old", "rejected"))
    batch = {
        "training": {"client_id": name, "run_name": name, "log_path": "l", "model_name": "m",
                     "status": "completed"},
        "tasks": [{"client_id": task, "task_id": task, "name": "rows task", "description": "d"}],
        "steps": [
            _step(name, 1, **{"rollout/cua/rows": 2.0, "rollout/cua/sampled_tokens": 147.0,
                              "rollout/cua/trained_tokens": 147.0,
                              "rollout/cua/dropped_turns": 0.0,
                              "cua_vision/row_images": 36.0, "cua_vision/distinct_images": 16.0,
                              "cua_vision/encoded_images": 16.0}),
            _step(name, 2, **{"rollout/cua/rows": 1.5, "rollout/cua/sampled_tokens": 150.0,
                              "rollout/cua/trained_tokens": 120.5,
                              "rollout/cua/dropped_turns": 0.5}),
            _step(name, 3, **{"rollout/cua/success": 1.0}),
        ],
        "rollouts": [
            _rollout(all_, step, task, metrics_json={"conversion": _conversion(), "timings": {}}),
            _rollout(dropped, step, task, metrics_json={"conversion": _conversion(
                rows=1, trained_turns=2, dropped_turns=1, trained_tokens=90)}),
            _rollout(old, step, task),
            _rollout(rejected, step, task, status="failed", reward=None,
                     status_message="missing_tokens"),
        ],
        "turns": [
            _turn(all_, 1, metrics_json={"trained": True}),
            _turn(all_, 2, metrics_json={"trained": True, "timings": {"model_s": 0.5}}),
            _turn(dropped, 1, metrics_json={"trained": True}),
            _turn(dropped, 2, metrics_json={"trained": False}),
            _turn(old, 1),
            _turn(old, 2, metrics_json={"timings": {"model_s": 0.5}}),
        ],
    }  # fmt: skip
    resp = httpx.post(
        f"{server.base_url}/api/ingest/batch", json=batch, headers=server.headers(), timeout=30
    )
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    ids = [r["id"] for r in answer["rollouts"]]
    return {
        "training_id": answer["training_id"],
        **dict(zip(("all", "dropped", "old", "rejected"), ids, strict=True)),
    }


def test_a_rollout_whose_rows_trained_every_token_says_so(user, trained):
    page = user.get(f"/rollouts/{trained['all']}").text
    assert _facts(page) == ("2", "147 / 147", False)
    assert "tokens dropped" not in page
    assert _pills(page) == ["trained", "trained"]


def test_dropped_tokens_are_highlighted_and_the_untrained_turn_is_marked(user, trained):
    page = user.get(f"/rollouts/{trained['dropped']}").text
    assert _facts(page) == ("1", "90 / 147", True)
    assert "57 tokens dropped, 1 turn not trained" in page
    assert _pills(page) == ["trained", "not trained"]


@pytest.mark.parametrize("which", ["old", "rejected"])
def test_a_rollout_without_conversion_stats_shows_dashes_and_no_pill(user, trained, which):
    resp = user.get(f"/rollouts/{trained[which]}")
    assert resp.status_code == 200
    assert _facts(resp.text) == ("–", "–", False)
    assert "not trained" not in resp.text
    assert _pills(resp.text) == ([None, None] if which == "old" else [])


def test_training_page_shows_rows_and_tokens_trained_and_sampled_per_episode(user, trained):
    page = user.get(f"/trainings/{trained['training_id']}").text
    cells = re.findall(r'<td class="num ep-tokens( dropped)?">([^<]*)</td>', page)
    assert cells == [("", "147 / 147"), (" dropped", "120.5 / 150"), ("", "–")]
    charts = {c["id"]: c for c in json.loads(html.unescape(
        re.search(r'<script type="application/json" id="chart-data"[^>]*>(.*?)</script>',
                  page, re.S).group(1)))}  # fmt: skip
    assert dict(charts["episode_tokens"]["series"]) == {
        "trained": [147.0, 120.5, None],
        "sampled": [147.0, 150.0, None],
    }
    assert dict(charts["episode_rows"]["series"]) == {"rows": [2.0, 1.5, None]}
    # The actor's vision tower per step: images in the rows, distinct, encoded.
    assert dict(charts["vision"]["series"]) == {
        "in rows": [36.0, None, None],
        "distinct": [16.0, None, None],
        "encoded": [16.0, None, None],
    }


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"metrics_json": {"conversion": _conversion()}}, (2, 147, 147, 0)),
        ({"metrics_json": json.dumps({"conversion": _conversion(trained_tokens=100)})},
         (2, 100, 147, 47)),
        ({"metrics_json": {"conversion": _conversion(rows=True, trained_tokens="147")}},
         (None, None, 147, 0)),
        ({"metrics_json": {"timings": {}}}, (None, None, None, 0)),
        ({"metrics_json": "not json"}, (None, None, None, 0)),
        ({}, (None, None, None, 0)),
    ],
)  # fmt: skip
def test_conversion_view_reads_what_it_can_and_never_fails(extra, expected):
    view = conversion_view(extra)
    got = (view["rows"], view["trained_tokens"], view["sampled_tokens"], view["dropped_tokens"])
    assert got == expected
