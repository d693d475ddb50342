"""The genv client against the real sim gym over HTTP, one test group per endpoint."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from PIL import Image

from cua_rl.clients.genv import GenvClient, parse_created, parse_evaluation
from cua_rl.errors import ConfigError, GymError
from cua_rl.sim.gym import GymServer, SimGymConfig
from tests.conftest import open_files_under

from .conftest import FAST, open_executions

WIFI_ON = "sim-001-wifi-on"
CALC_ANSWER = "sim-013-calc-answer"
WIFI_TOGGLE = (300, 116)  # where the Wi-Fi switch is drawn on the 360x640 settings screen
SETTINGS_ICON = (70, 130)


async def act(http, gym, eid, name, **args):
    r = await http.post(
        f"{gym.base_url}/executions/{eid}/actions", json={"name": name, "args": args}
    )
    return r


# -- tasks -------------------------------------------------------------------------------------
async def test_list_tasks_returns_every_task_with_ids(genv):
    tasks = await genv.list_tasks()
    assert len(tasks) >= 12
    ids = [t["task_id"] for t in tasks]
    assert len(set(ids)) == len(ids)
    assert {"easy", "normal", "hard"} <= {tag for t in tasks for tag in t["tags"]}


async def test_get_task_is_richer_than_the_list_entry(genv):
    detail = await genv.get_task(WIFI_ON)
    assert detail["task_id"] == WIFI_ON
    assert "Wi-Fi" in detail["instruction"]
    assert detail["evaluation"]["validators"]


async def test_get_unknown_task_is_a_404_gym_error_with_detail(genv):
    with pytest.raises(GymError) as ei:
        await genv.get_task("no-such-task")
    assert ei.value.status == 404
    assert "no-such-task" in str(ei.value)


async def test_wrong_gym_id_is_reported_not_leaked(gym):
    async with GenvClient(gym.url, "other", timeouts=FAST) as client:
        with pytest.raises(GymError, match="unknown gym id 'other'") as ei:
            await client.create_execution(WIFI_ON)
    assert ei.value.status == 404


def test_missing_gym_id_or_bad_url_is_a_config_error():
    with pytest.raises(ConfigError, match="gym_id"):
        GenvClient("http://127.0.0.1:1", "")
    with pytest.raises(ConfigError, match="http"):
        GenvClient("127.0.0.1:1", "sim")


# -- create / evaluate / terminate --------------------------------------------------------------
async def test_create_evaluate_act_evaluate_terminate(genv, gym, http):
    created = await genv.create_execution(WIFI_ON)
    assert created.execution_id and created.box_id
    listed = await open_executions(http, gym)
    assert [e["execution_id"] for e in listed] == [created.execution_id]
    assert listed[0]["task_id"] == WIFI_ON

    before = await genv.evaluate(created.execution_id)
    assert before.call_ok is True and before.success is False and before.score == 0.0
    assert [v.passed for v in before.validators] == [False]

    assert (
        await act(http, gym, created.execution_id, "tap", x=SETTINGS_ICON[0], y=SETTINGS_ICON[1])
    ).json()["screen"] == "settings"
    assert (
        await act(http, gym, created.execution_id, "tap", x=WIFI_TOGGLE[0], y=WIFI_TOGGLE[1])
    ).json()["ok"] is True
    after = await genv.evaluate(created.execution_id, execution_data={"steps": 2})
    assert after.success is True and after.score == 1.0
    assert after.validators[0].weight == 1.0

    await genv.terminate(created.execution_id)
    assert await open_executions(http, gym) == []
    again = await genv.terminate(created.execution_id)  # idempotent
    assert again["already_terminated"] is True


async def test_answer_text_reaches_the_validators(genv, gym, http):
    created = await genv.create_execution(CALC_ANSWER)
    r = await act(http, gym, created.execution_id, "tap", x=290, y=130)  # Calculator icon
    assert r.json()["screen"] == "calculator"
    assert (await act(http, gym, created.execution_id, "type", text="37*3=")).json()["ok"]
    wrong = await genv.evaluate(created.execution_id, answer_text="the result is 112")
    right = await genv.evaluate(created.execution_id, answer_text="The result is 111")
    assert {v.id: v.passed for v in wrong.validators} == {
        "calculator_result": True,
        "answer": False,
    }
    assert right.success is True
    await genv.terminate(created.execution_id)


async def test_evaluate_and_actions_on_closed_or_unknown_executions(genv, gym, http):
    created = await genv.create_execution(WIFI_ON)
    await genv.terminate(created.execution_id)
    with pytest.raises(GymError) as ei:
        await genv.evaluate(created.execution_id)
    assert ei.value.status == 409
    assert (await act(http, gym, created.execution_id, "home")).status_code == 409
    assert (await act(http, gym, "ex-unknown", "home")).status_code == 404
    with pytest.raises(GymError) as ei:
        await genv.terminate("ex-unknown")  # a first-attempt 404 is not silently "done"
    assert ei.value.status == 404


async def test_execution_scope_terminates_on_normal_exit_and_on_error(genv, gym, http):
    async with genv.execution(WIFI_ON) as ex:
        assert [e["execution_id"] for e in await open_executions(http, gym)] == [ex.execution_id]
        result = await ex.evaluate()
        assert result.success is False
    assert await open_executions(http, gym) == []
    with pytest.raises(RuntimeError, match="boom"):
        async with genv.execution(WIFI_ON):
            raise RuntimeError("boom")
    assert await open_executions(http, gym) == []


async def test_early_terminate_makes_the_scope_exit_a_no_op(genv, gym, http):
    async with genv.execution(WIFI_ON) as ex:
        await ex.terminate()
        assert await open_executions(http, gym) == []
    assert genv.stats["terminated"] == 1


@pytest.mark.parametrize("gym_config", [SimGymConfig(max_live=2)])
async def test_cap_on_live_executions_answers_429_with_detail(genv, gym, http):
    a = await genv.create_execution(WIFI_ON)
    b = await genv.create_execution(WIFI_ON)
    with pytest.raises(GymError, match="too many live executions") as ei:
        await genv.create_execution(WIFI_ON)
    assert ei.value.status == 429
    await genv.terminate(a.execution_id)
    c = await genv.create_execution(WIFI_ON)  # room again
    for x in (b, c):
        await genv.terminate(x.execution_id)
    assert await open_executions(http, gym) == []


async def test_executions_are_isolated(genv, gym, http):
    a = await genv.create_execution(WIFI_ON)
    b = await genv.create_execution(WIFI_ON)
    for x, y in (SETTINGS_ICON, WIFI_TOGGLE):
        await act(http, gym, a.execution_id, "tap", x=x, y=y)
    assert (await genv.evaluate(a.execution_id)).success is True
    assert (await genv.evaluate(b.execution_id)).success is False
    for x in (a, b):
        await genv.terminate(x.execution_id)


# -- screenshots and actions ---------------------------------------------------------------------
async def test_screenshot_is_a_phone_png_and_stays_fetchable_after_terminate(genv, gym, http):
    created = await genv.create_execution(WIFI_ON)
    r = await http.post(f"{gym.base_url}/executions/{created.execution_id}/screenshot")
    shot = r.json()
    assert (shot["index"], shot["width"], shot["height"]) == (0, 360, 640)
    png = base64.b64decode(shot["data_url"].split(",", 1)[1])
    assert Image.open(io.BytesIO(png)).size == (360, 640)
    await act(http, gym, created.execution_id, "tap", x=SETTINGS_ICON[0], y=SETTINGS_ICON[1])
    second = (
        await http.post(f"{gym.base_url}/executions/{created.execution_id}/screenshot")
    ).json()
    assert second["index"] == 1
    await genv.terminate(created.execution_id)
    fetched = await http.get(shot["url"])
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    assert fetched.content == png  # immutable: the home screen, not the settings screen
    assert (await http.get(second["url"])).content != png
    missing = await http.get(shot["url"].replace("/0.png", "/7.png"))
    assert missing.status_code == 404


async def test_same_seed_same_pixels_other_seed_other_start(genv, gym, http):
    async def first_png(seed):
        c = await genv.create_execution("sim-004-open-calculator", options={"seed": seed})
        shot = (await http.post(f"{gym.base_url}/executions/{c.execution_id}/screenshot")).json()
        await genv.terminate(c.execution_id)
        return (await http.get(shot["url"])).content

    a, b = await first_png(0), await first_png(0)
    assert a == b
    others = {await first_png(s) for s in range(1, 8)}
    assert len(others | {a}) > 1  # status-bar flags differ across seeds


@pytest.mark.parametrize("gym_config", [SimGymConfig(width=270, height=480)])
async def test_screen_size_is_configurable_and_taps_scale(genv, gym, http):
    c = await genv.create_execution(WIFI_ON)
    shot = (await http.post(f"{gym.base_url}/executions/{c.execution_id}/screenshot")).json()
    assert (shot["width"], shot["height"]) == (270, 480)
    assert Image.open(io.BytesIO((await http.get(shot["url"])).content)).size == (270, 480)
    await act(http, gym, c.execution_id, "tap", x=70 * 0.75, y=130 * 0.75)
    await act(http, gym, c.execution_id, "tap", x=300 * 0.75, y=116 * 0.75)
    assert (await genv.evaluate(c.execution_id)).success is True
    await genv.terminate(c.execution_id)


@pytest.mark.parametrize(
    "body",
    [
        {"name": "fly", "args": {}},
        {"name": "tap", "args": {"x": 10}},
        {"name": "tap", "args": {"x": 10, "y": 9999}},
        {"name": "tap", "args": {"x": "10", "y": 10}},
        {"name": "type", "args": {"text": 5}},
        {"name": "key", "args": {"key": "f13"}},
        {"name": "wait", "args": {"seconds": -1}},
    ],
)
async def test_malformed_actions_answer_400(genv, gym, http, body):
    c = await genv.create_execution(WIFI_ON)
    r = await http.post(f"{gym.base_url}/executions/{c.execution_id}/actions", json=body)
    assert r.status_code == 400 and r.json()["detail"]
    await genv.terminate(c.execution_id)


async def test_actions_that_miss_are_ok_false_with_a_reason(genv, gym, http):
    c = await genv.create_execution(WIFI_ON)
    r = (await act(http, gym, c.execution_id, "type", text="hello")).json()
    assert r["ok"] is False and "focused" in r["error"]
    r = (await act(http, gym, c.execution_id, "tap", x=180, y=500)).json()
    assert r["ok"] is False and r["screen"] == "home"
    assert (await act(http, gym, c.execution_id, "wait", seconds=0.5)).json()["ok"] is True
    await genv.terminate(c.execution_id)


# -- idle expiry, faults endpoint, health, CLI ---------------------------------------------------
# Long enough for the create and the screenshot to come first on a loaded machine: one that
# expired in between (or during the capture) would answer 409, not the screenshot.
@pytest.mark.parametrize("gym_config", [SimGymConfig(idle_ttl_s=2.0)])
async def test_idle_executions_expire(genv, gym, http):
    c = await genv.create_execution(WIFI_ON)
    shot = (await http.post(f"{gym.base_url}/executions/{c.execution_id}/screenshot")).json()
    deadline = time.monotonic() + 60  # a bound for a reaper that never runs, not its speed
    while await open_executions(http, gym) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert await open_executions(http, gym) == []
    assert (await http.get(shot["url"])).status_code == 200
    health = (await http.get(f"{gym.url}/healthz")).json()
    assert health["counters"]["expired"] == 1


@pytest.mark.parametrize("gym_config", [SimGymConfig(screenshot_retention_s=0.2)])
async def test_screenshots_expire_after_retention(genv, gym, http):
    c = await genv.create_execution(WIFI_ON)
    shot = (await http.post(f"{gym.base_url}/executions/{c.execution_id}/screenshot")).json()
    await genv.terminate(c.execution_id)
    # The expiry runs in the gym's background: wait for it (bounded) instead of a fixed delay.
    deadline = time.monotonic() + 60
    while (await http.get(shot["url"])).status_code != 404 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert (await http.get(shot["url"])).status_code == 404


async def test_fault_endpoint_round_trips_and_rejects_nonsense(gym, http):
    url = f"{gym.url}/api/v1/_sim/faults"
    assert (await http.get(url)).json()["create"] == {
        "fail_rate": 0.0,
        "latency_s": 0.0,
        "drop_rate": 0.0,
    }
    r = await http.put(url, json={"evaluate": {"fail_rate": 0.25, "latency_s": 0.1}})
    assert r.json()["evaluate"] == {"fail_rate": 0.25, "latency_s": 0.1, "drop_rate": 0.0}
    assert (await http.put(url, json={"evaluate": {"fail_rate": 2}})).status_code == 400
    assert (await http.put(url, json={"boot": {"fail_rate": 0.1}})).status_code == 400
    assert (await http.get(url)).json()["evaluate"]["fail_rate"] == 0.25


def test_cli_serves_the_gym_and_prints_its_url(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cua_rl.sim",
            "gym",
            "--port",
            "0",
            "--gym-id",
            "cli",
            "--max-live",
            "3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("ready http://127.0.0.1:") and line.endswith("/api/v1/cli")
        base = line.split()[1]
        assert len(httpx.get(f"{base}/tasks", timeout=5).json()["tasks"]) >= 12
        root = base.rsplit("/api/", 1)[0]
        assert httpx.get(f"{root}/healthz", timeout=5).json()["gym_id"] == "cli"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


def test_cli_rejects_bad_options_with_a_message():
    out = subprocess.run(
        [sys.executable, "-m", "cua_rl.sim", "gym", "--port", "0", "--create-fail-rate", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "fail_rate" in out.stderr


# -- answer parsing (hand-written answers in each documented shape) --------------------------------
def test_parse_evaluation_reads_every_documented_shape():
    current = {
        "success": True,
        "result": {
            "score": 0.0,
            "success": False,
            "validators": [{"id": "a", "pass": False, "score": 0, "weight": 2}],
        },
    }
    r = parse_evaluation(current)
    assert (r.call_ok, r.score, r.success) == (True, 0.0, False)
    assert r.validators[0].weight == 2.0 and r.validators[0].passed is False
    older = {"final_result": {"score": 1, "checks": [{"name": "x", "passed": True}]}}
    r = parse_evaluation(older)
    assert (r.call_ok, r.score, r.success, r.validators[0].id) == (None, 1.0, None, "x")
    oldest = {"evaluation_result": {"final_result": {"success": True}}}
    assert parse_evaluation(oldest).success is True


@pytest.mark.parametrize(
    "answer",
    [
        {"success": True},
        {"success": False, "detail": "box gone"},
        {"result": {"score": "high"}},
        {"result": {"validators": [{"id": "a"}]}},
        {"result": {"validators": "all good"}},
        [1, 2],
    ],
)
def test_parse_evaluation_refuses_answers_without_a_usable_verdict(answer):
    with pytest.raises(GymError):
        parse_evaluation(answer)


def test_parse_created_finds_box_ids_in_every_spelling():
    assert parse_created({"execution_id": "e", "gbox_id": "g"}, "t").box_id == "g"
    assert parse_created({"execution_id": "e", "device": {"device_serial": "d"}}, "t").box_id == "d"
    assert parse_created({"execution_id": 7, "box": {"id": "b"}}, "t").execution_id == "7"
    assert parse_created({"execution_id": "e"}, "t").box_id is None
    with pytest.raises(GymError, match="execution_id"):
        parse_created({"id": "e"}, "t")


async def test_caller_injected_client_is_used_and_not_closed(gym):
    seen = []

    async def hook(request):
        seen.append(request.url.path)

    async with httpx.AsyncClient(event_hooks={"request": [hook]}) as shared:
        async with GenvClient(gym.url, gym.gym_id, client=shared, timeouts=FAST) as client:
            await client.list_tasks()
        assert not shared.is_closed
    assert seen == ["/api/v1/sim/tasks"]


def test_gym_server_fixture_shape():
    with GymServer(SimGymConfig(gym_id="x")) as g:
        assert g.base_url.endswith("/api/v1/x")
        assert httpx.get(f"{g.url}/healthz").json()["ok"] is True


@pytest.mark.parametrize("gym_config", [SimGymConfig(max_retained_bytes=2 * 14_000)])
async def test_retained_screenshots_are_bounded_in_bytes_oldest_first(genv, gym, http):
    urls = []
    for _ in range(3):
        c = await genv.create_execution(WIFI_ON)
        shot = (await http.post(f"{gym.base_url}/executions/{c.execution_id}/screenshot")).json()
        assert 8_000 < len(base64.b64decode(shot["data_url"].split(",", 1)[1])) < 14_000
        urls.append(shot["url"])
        await genv.terminate(c.execution_id)
    codes = [(await http.get(u)).status_code for u in urls]
    assert codes == [404, 200, 200]


# -- screenshots kept after terminate, on disk -------------------------------------------------
async def _shoot(http, gym, eid) -> tuple[str, bytes]:
    shot = (await http.post(f"{gym.base_url}/executions/{eid}/screenshot")).json()
    return shot["url"], base64.b64decode(shot["data_url"].split(",", 1)[1])


async def _screenshot_health(http, gym) -> dict:
    return (await http.get(f"{gym.url}/healthz")).json()["screenshots"]


async def test_terminated_screenshots_leave_memory_and_are_served_byte_identical(http, tmp_path):
    with GymServer(SimGymConfig(screenshot_spill_dir=str(tmp_path))) as g:
        async with GenvClient(g.url, g.gym_id, timeouts=FAST) as genv:
            c = await genv.create_execution(WIFI_ON)
            first = await _shoot(http, g, c.execution_id)
            await act(http, g, c.execution_id, "tap", x=SETTINGS_ICON[0], y=SETTINGS_ICON[1])
            second = await _shoot(http, g, c.execution_id)
            shots = [first, second]
            assert first[1] != second[1]
            size = len(first[1]) + len(second[1])
            assert (await _screenshot_health(http, g))["memory_bytes"] == size
            await genv.terminate(c.execution_id)
            health = await _screenshot_health(http, g)
            assert health == {
                "memory_bytes": 0, "retained_executions": 1, "retained_bytes": size,
                "disk_bytes": size,
            }  # fmt: skip
            for url, png in shots:
                r = await http.get(url)
                assert r.status_code == 200 and r.content == png
            # An unnamed file in the given folder: nothing to clean up even if the gym is killed.
            assert list(tmp_path.iterdir()) == []
            assert [t.endswith(" (deleted)") for t in open_files_under(tmp_path)] == [True]
    assert open_files_under(tmp_path) == []  # closed, so freed, when the gym stopped


@pytest.mark.parametrize("gym_config", [SimGymConfig(max_retained_executions=1)])
async def test_a_dropped_execution_s_screenshots_are_no_longer_counted(genv, gym, http):
    shots = []
    for _ in range(2):
        c = await genv.create_execution(WIFI_ON)
        shots.append(await _shoot(http, gym, c.execution_id))
        await genv.terminate(c.execution_id)
    assert [(await http.get(url)).status_code for url, _ in shots] == [404, 200]
    health = await _screenshot_health(http, gym)
    assert (health["retained_executions"], health["retained_bytes"]) == (1, len(shots[1][1]))


async def test_a_spill_that_cannot_be_written_is_counted_not_silent(http, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with GymServer(SimGymConfig(screenshot_spill_dir=str(not_a_dir))) as g:
        async with GenvClient(g.url, g.gym_id, timeouts=FAST) as genv:
            c = await genv.create_execution(WIFI_ON)
            url, _ = await _shoot(http, g, c.execution_id)
            await genv.terminate(c.execution_id)
            health = (await http.get(f"{g.url}/healthz")).json()
            assert health["counters"]["spill_errors"] == 1
            assert health["screenshots"]["memory_bytes"] == 0
            assert (await http.get(url)).status_code == 404


# -- the box routes (an agent function's box: cua_rl/agent/function.py) -----------------------
async def test_the_box_routes_screenshot_act_and_a_refused_action_that_is_no_failure(genv):
    async with genv.execution(WIFI_ON) as ex:
        shot = await genv.screenshot(ex.execution_id)
        png = base64.b64decode(shot["data_url"].split(",", 1)[1])
        assert Image.open(io.BytesIO(png)).size == (shot["width"], shot["height"])
        tap = {"name": "tap", "args": dict(zip("xy", SETTINGS_ICON, strict=True))}
        done = await genv.act(ex.execution_id, tap)
        assert done.get("ok") is True and done.get("screen") == "settings", done
        refused = await genv.act(ex.execution_id, {"name": "tap", "args": {"x": -5, "y": 10}})
        assert refused["ok"] is False and refused["status"] == 400 and refused["error"], refused
        with pytest.raises(GymError, match="answered 404"):
            await genv.act("no-such-execution", {"name": "back", "args": {}})
