"""Tasks a user writes for the local gym: a YAML file served beside the built-in tasks.

Over real HTTP: the file's tasks are listed, start as written, are judged by their validators,
and their details carry the solution and whether they read an answer. Every mistake in a file is
one error naming the file, the task and the key, and the gym does not start. Each action's
answer says whether it changed the phone's state.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from cua_rl.errors import ConfigError
from cua_rl.sim.gym import GymServer, SimGymConfig
from cua_rl.sim.phone_backend import PhoneBackend
from cua_rl.sim.phone_tasks import TASKS
from tests.audit.conftest import PLANTED, REPO


async def act(http, gym, eid: str, name: str, **args) -> dict:
    r = await http.post(
        f"{gym.base_url}/executions/{eid}/actions", json={"name": name, "args": args}
    )
    assert r.status_code == 200, r.text
    return r.json()


async def test_the_files_tasks_are_served_beside_the_built_in_ones(genv):
    listed = {t["task_id"]: t for t in await genv.list_tasks()}
    assert {t.task_id for t in TASKS} < set(listed)
    user = {k: v for k, v in listed.items() if k.startswith("user-")}
    assert list(user) == [
        "user-free-start",
        "user-coin-flip",
        "user-wrong-field",
        "user-clean-wifi",
        "user-clean-note",
        "user-free-answer",
    ]
    # Numbered after the built-in tasks, in file order; tagged with their level and app.
    first = len(TASKS) + 1  # 22 built-in tasks since the learn-long family
    assert [t["task_number"] for t in user.values()] == list(range(first, first + 6))
    assert user["user-clean-note"]["tags"] == ["user", "notes"]
    detail = await genv.get_task("user-clean-note")
    assert detail["solution"][2] == 'type("buy eggs")'
    assert detail["evaluation"]["reads_answer"] is False
    assert (await genv.get_task("user-coin-flip"))["evaluation"]["reads_answer"] is True


async def test_a_file_task_starts_as_written_and_its_validators_judge_it(genv, gym, http):
    async with genv.execution("user-clean-note") as ex:
        before = await ex.evaluate()
        assert before.score == 0.0 and before.success is False
        for step in (
            ("tap", {"x": 180, "y": 130}),
            ("tap", {"x": 305, "y": 50}),
            ("type", {"text": "buy eggs"}),
            ("tap", {"x": 280, "y": 345}),
        ):
            await act(http, gym, ex.execution_id, step[0], **step[1])
        after = await ex.evaluate()
    assert after.success is True and after.score == 1.0
    assert [(v.id, v.passed) for v in after.validators] == [
        ("note_saved", True),
        ("one_note", True),
    ]
    async with genv.execution("user-free-start") as ex:
        free = await ex.evaluate()
    assert free.success is True  # the planted fault: it starts solved


async def test_an_action_answer_says_whether_the_state_changed(genv, gym, http):
    async with genv.execution("user-clean-wifi") as ex:
        eid = ex.execution_id
        assert (await act(http, gym, eid, "tap", x=180, y=420))["changed"] is False  # nothing there
        assert (await act(http, gym, eid, "wait", seconds=0))["changed"] is False
        assert (await act(http, gym, eid, "tap", x=70, y=130))["changed"] is True  # Settings
        assert (await act(http, gym, eid, "type", text="x"))["changed"] is False  # no field
        switch = await act(http, gym, eid, "tap", x=300, y=116)
        before, after = switch.pop("state_key_before"), switch.pop("state_key_after")
        assert switch == {"ok": True, "error": None, "screen": "settings", "changed": True}
        assert before != after  # what `changed` says, from the two keys the answer names


def write(tmp_path, text: str):
    path = tmp_path / "tasks.yaml"
    path.write_text(text)
    return path


TASK = """tasks:
  - name: t
    description: Turn Wi-Fi on.
    app: settings
    validators:
      - {id: w, field: wifi, equals: true}
"""


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("app: settings", "app: garage"), "app 'garage' is not one of settings"),
        (("app: settings", "app: settings\n    colour: red"), "unknown keys ['colour']"),
        (("field: wifi", "field: wlan"), "validators[0].field 'wlan' is not a phone state field"),
        (("equals: true", "equals: 3"), "validators[0].equals must be a bool"),
        (("equals: true", "at_least: 1, equals: true"), "'field' needs exactly one of"),
        (("{id: w, field: wifi, equals: true}", "{id: w}"), "validators[0] needs exactly one of"),
        (("{id: w, field: wifi, equals: true}", "{python: 'nowhere:fn'}"), "cannot be imported"),
        (("app: settings", "app: settings\n    start: {brightness: 300}"), "within 0..100"),
        (("app: settings", "app: settings\n    start: {screen: moon}"), "start.screen 'moon'"),
        (("app: settings", "app: settings\n    start: {volume: 3}"), "start.volume is not a phone"),
        (("app: settings", "app: settings\n    solution: ['jump()']"), "solution[0] 'jump()'"),
        (("description: Turn Wi-Fi on.", "description: ''"), "'description' is required"),
    ],
)
def test_a_mistake_in_a_task_file_is_one_error_naming_the_file_task_and_key(
    tmp_path, change, message
):
    path = write(tmp_path, TASK.replace(*change))
    with pytest.raises(ConfigError) as err:
        PhoneBackend(task_files=[str(path)])
    assert str(err.value).startswith(f"{path}: task 't': ")
    assert message in str(err.value)


def test_ids_and_numbers_may_not_repeat_across_files_and_built_in_tasks(tmp_path):
    path = write(tmp_path, TASK.replace("name: t", "name: t\n    id: sim-001-wifi-on"))
    with pytest.raises(ConfigError, match="task id 'sim-001-wifi-on' is given twice"):
        PhoneBackend(task_files=[str(path)])
    path = write(tmp_path, TASK.replace("name: t", "name: t\n    number: 3"))
    with pytest.raises(ConfigError, match="task number 3 is given twice"):
        PhoneBackend(task_files=[str(path)])
    with pytest.raises(ConfigError, match="no such task file"):
        PhoneBackend(task_files=[str(tmp_path / "missing.yaml")])


def test_task_files_are_phone_tasks():
    with pytest.raises(ConfigError, match="task files hold phone tasks"):
        SimGymConfig(backend="browser", task_files=[str(PLANTED)])


def test_the_gym_command_refuses_a_bad_task_file_with_one_line(tmp_path):
    path = write(tmp_path, TASK.replace("app: settings", "app: garage"))
    proc = subprocess.run(
        [sys.executable, "-m", "cua_rl.sim", "gym", "--port", "0", "--task-file", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {path}: task 't': app 'garage' is not one of "
        "settings, notes, calculator, camera, clock, maps"
    ]


def test_a_solution_is_scaled_to_the_gyms_screen():
    config = SimGymConfig(width=720, height=1280, task_files=[str(PLANTED)])
    with GymServer(config) as server:
        detail = server.gym.backend.detail("user-clean-wifi")
    assert detail["solution"] == ["tap(140, 260)", "tap(600, 232)"]
