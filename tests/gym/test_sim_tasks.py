"""Every sim task: a scripted correct action sequence solves it, a wrong one fails it.

Scripts go through the HTTP action endpoint with coordinates read off the 360x640 screenshots
(written here by hand, not taken from the phone's layout code), and verdicts come from the
genv evaluate endpoint.
"""

from __future__ import annotations

import pytest

from .conftest import open_executions

HOME = {"settings": (70, 130), "notes": (180, 130), "calculator": (290, 130), "clock": (180, 260)}
WIFI, BLUETOOTH = (300, 116), (300, 186)
SLIDER_Y = 290  # track runs from x=30 (0%) to x=330 (100%)
NEW_NOTE, SAVE, CANCEL = (305, 50), (280, 345), (80, 345)
# Centres of the cells of a 3x3 grid over 360x640, row by row (the lenient agent's taps).
GRID = [(x, y) for y in (106, 320, 533) for x in (60, 180, 300)]
# Centres of a 10x10 grid's cells on the 360x640 screen, row by row: 36 x 64 pixel cells.
GRID10 = [(18 + 36 * col, 32 + 64 * row) for row in range(10) for col in range(10)]
CALC = {
    k: (51 + 86 * c, 239 + 90 * r)
    for r, row in enumerate(("789/", "456*", "123-", "C0=+"))
    for c, k in enumerate(row)
}


def tap(xy):
    return ("tap", {"x": xy[0], "y": xy[1]})


def typ(text):
    return ("type", {"text": text})


def app(name):
    return tap(HOME[name])


def keys(seq):
    return [tap(CALC[k]) for k in seq]


def note(text):
    return [tap(NEW_NOTE), typ(text), tap(SAVE)]


# task id -> (correct script, correct answer, wrong script, wrong answer)
SCRIPTS = {
    "sim-001-wifi-on": (
        [app("settings"), tap(WIFI)],
        None,
        [app("settings"), tap(BLUETOOTH)],
        None,
    ),
    "sim-002-wifi-off": (
        [app("settings"), tap(WIFI)],
        None,
        [app("settings"), tap(BLUETOOTH)],
        None,
    ),
    "sim-003-bluetooth-off": (
        [app("settings"), tap(BLUETOOTH)],
        None,
        [app("settings"), tap(WIFI)],
        None,
    ),
    "sim-004-open-calculator": ([app("calculator")], None, [app("clock")], None),
    "sim-005-brightness-max": (
        [app("settings"), ("swipe", {"x1": 120, "y1": SLIDER_Y, "x2": 359, "y2": SLIDER_Y})],
        None,
        [app("settings"), tap((250, SLIDER_Y))],
        None,
    ),
    "sim-006-brightness-half": (
        [app("settings"), tap((180, SLIDER_Y))],
        None,
        [app("settings"), tap((90, SLIDER_Y))],
        None,
    ),
    "sim-007-note-milk": (
        [app("notes"), *note("buy milk")],
        None,
        [app("notes"), tap(NEW_NOTE), typ("buy milk"), ("back", {})],  # back discards the draft
        None,
    ),
    "sim-008-calc-add": (
        [app("calculator"), *keys("12+7=")],
        None,
        [app("calculator"), *keys("12+8=")],
        None,
    ),
    "sim-009-bluetooth-on-wifi-off": (
        [app("settings"), tap(WIFI), tap(BLUETOOTH)],
        None,
        [app("settings"), tap(WIFI)],
        None,
    ),
    "sim-010-quiet-mode": (
        [app("settings"), tap(WIFI), tap(BLUETOOTH), tap((60, SLIDER_Y))],
        None,
        [app("settings"), tap(WIFI), tap(BLUETOOTH)],
        None,
    ),
    "sim-011-two-notes": (
        [app("notes"), *note("alpha"), *note("beta")],
        None,
        [app("notes"), *note("alpha"), tap(NEW_NOTE), typ("beta"), tap(CANCEL)],
        None,
    ),
    # Starting notes: "keep me", "old plan", "shopping" (rows at y=112, 168, 224).
    "sim-012-delete-old-note": (
        [app("notes"), tap((320, 168))],
        None,
        [app("notes"), tap((320, 112))],
        None,
    ),
    "sim-013-calc-answer": (
        [app("calculator"), *keys("37*3=")],
        "111",
        [app("calculator"), *keys("37*3=")],
        "112",
    ),
    # The learn family: one tap on the top-right cell's centre (Calculator icon / Wi-Fi switch).
    "sim-014-learn-open-calculator": ([tap(GRID[2])], None, [tap(GRID[1])], None),
    "sim-015-learn-wifi-on": ([tap(GRID[2])], None, [tap(BLUETOOTH)], None),
    "sim-016-learn-wifi-off": ([tap(GRID[2])], None, [tap(BLUETOOTH)], None),
    # The learn2 family: the top-right cell (the Wi-Fi switch) twice; once is not enough.
    "sim-017-learn2-wifi-off-on": ([tap(GRID[2]), tap(GRID[2])], None, [tap(GRID[2])], None),
    "sim-018-learn2-wifi-on-off": (
        [tap(GRID[2]), tap(GRID[2])],
        None,
        [tap(GRID[2]), tap(BLUETOOTH)],
        None,
    ),
    # The learn-hard family: the Wi-Fi switch, at the centre of cell 17 of a 10x10 grid.
    "sim-019-learn-hard-wifi-on": ([tap(GRID10[17])], None, [tap(BLUETOOTH)], None),
    "sim-020-learn-hard-wifi-off": ([tap(GRID10[18])], None, [tap(BLUETOOTH)], None),
    # The learn-long family: the middle band (Next) four times, detours (Back, the top band)
    # allowed; the bottom band on the trap page erases everything.
    "sim-021-learn-long-setup-trap2": (
        [tap(GRID[4])] * 4,
        None,
        [tap(GRID[4]), tap(GRID[6])],
        None,
    ),
    "sim-022-learn-long-setup-trap3": (
        [tap(GRID[3]), tap(GRID[1]), tap(GRID[5]), tap(GRID[4]), tap(GRID[4]), tap(GRID[3])],
        None,
        [tap(GRID[4]), tap(GRID[4]), tap(GRID[8])],
        None,
    ),
}
LEARN = ("sim-014-learn-open-calculator", "sim-015-learn-wifi-on", "sim-016-learn-wifi-off")


async def run_script(genv, gym, http, task_id, script, answer):
    async with genv.execution(task_id) as ex:
        for name, args in script:
            r = await http.post(
                f"{gym.base_url}/executions/{ex.execution_id}/actions",
                json={"name": name, "args": args},
            )
            assert r.status_code == 200, r.text
            assert r.json()["ok"], (name, args, r.json())
        return await ex.evaluate(answer_text=answer)


async def test_every_served_task_has_a_script_and_all_levels_exist(genv):
    tasks = await genv.list_tasks()
    assert {t["task_id"] for t in tasks} == set(SCRIPTS)
    assert {"easy", "normal", "hard", "learn", "learn2", "learn-hard", "learn-long"} <= {
        tag for t in tasks for tag in t["tags"]
    }


@pytest.mark.parametrize("task_id", sorted(SCRIPTS))
async def test_correct_script_solves_the_task(genv, gym, http, task_id):
    script, answer, _, _ = SCRIPTS[task_id]
    result = await run_script(genv, gym, http, task_id, script, answer)
    assert result.success is True
    assert result.score == 1.0
    assert result.validators and all(v.passed for v in result.validators)
    assert await open_executions(http, gym) == []


@pytest.mark.parametrize("task_id", sorted(SCRIPTS))
async def test_wrong_script_fails_the_task(genv, gym, http, task_id):
    _, _, script, answer = SCRIPTS[task_id]
    result = await run_script(genv, gym, http, task_id, script, answer)
    assert result.success is False
    assert result.score < 1.0
    assert any(not v.passed for v in result.validators)


@pytest.mark.parametrize("task_id", sorted(SCRIPTS))
async def test_doing_nothing_fails_the_task(genv, task_id):
    async with genv.execution(task_id) as ex:
        result = await ex.evaluate()
    assert result.success is False and result.score == 0.0


async def test_partial_credit_follows_validator_weights(genv, gym, http):
    # quiet_mode weights: wifi 1, bluetooth 1, brightness 2 -> both toggles alone score 2/4.
    _, _, script, _ = SCRIPTS["sim-010-quiet-mode"]
    result = await run_script(genv, gym, http, "sim-010-quiet-mode", script, None)
    assert result.score == pytest.approx(0.5)
    assert {v.id: v.passed for v in result.validators} == {
        "wifi_off": True,
        "bluetooth_off": True,
        "brightness_low": False,
    }


async def test_typing_into_the_calculator_works_like_tapping(genv, gym, http):
    result = await run_script(
        genv, gym, http, "sim-008-calc-add", [app("calculator"), typ("12+7=")], None
    )
    assert result.success is True


@pytest.mark.parametrize(
    "answer, passes",
    [
        ("111", True),
        ("111.", True),
        ("The result is 1,11", True),
        ("1111", False),
        ("111.5", False),
        ("", False),
    ],
)
async def test_final_answer_must_state_the_number(genv, gym, http, answer, passes):
    script, _, _, _ = SCRIPTS["sim-013-calc-answer"]
    result = await run_script(genv, gym, http, "sim-013-calc-answer", script, answer)
    assert result.success is passes


async def solving_cells(genv, gym, http, task_id, centres) -> list[int]:
    """The cells whose centre, tapped once on a fresh execution, solves the task."""
    solved = []
    for cell, (x, y) in enumerate(centres):
        async with genv.execution(task_id) as ex:
            r = await http.post(
                f"{gym.base_url}/executions/{ex.execution_id}/actions",
                json={"name": "tap", "args": {"x": x, "y": y}},
            )
            assert r.status_code == 200, r.text
            if (await ex.evaluate()).success:
                solved.append(cell)
    return solved


@pytest.mark.parametrize("task_id", LEARN)
async def test_exactly_one_grid_cell_solves_each_learn_task(genv, gym, http, task_id):
    # The family's scripted difficulty: one tap on a random cell solves it with probability 1/9.
    assert await solving_cells(genv, gym, http, task_id, GRID) == [2]


LEARN2 = ("sim-017-learn2-wifi-off-on", "sim-018-learn2-wifi-on-off")


@pytest.mark.parametrize("task_id", LEARN2)
async def test_only_the_two_tap_sequence_solves_each_learn2_task(genv, gym, http, task_id):
    # Every pair of grid cells (81 episodes per task): only the switch twice (2, 2) solves it, so
    # a uniformly random cell per step succeeds with 1/81; one flip, at either step, scores 0.5.
    solved, scores = [], {}
    for first, second in [(a, b) for a in range(9) for b in range(9)]:
        async with genv.execution(task_id) as ex:
            for cell in (first, second):
                x, y = GRID[cell]
                r = await http.post(
                    f"{gym.base_url}/executions/{ex.execution_id}/actions",
                    json={"name": "tap", "args": {"x": x, "y": y}},
                )
                assert r.status_code == 200, r.text
            result = await ex.evaluate()
            scores[(first, second)] = result.score
            if result.success:
                solved.append((first, second))
    assert solved == [(2, 2)]
    halves = {pair for pair, score in scores.items() if score == 0.5}
    assert halves == {(2, b) for b in range(9) if b != 2} | {(a, 2) for a in range(9) if a != 2}
    assert all(score == 0.0 for pair, score in scores.items() if pair not in {(2, 2), *halves})


LEARN_HARD = ("sim-019-learn-hard-wifi-on", "sim-020-learn-hard-wifi-off")


@pytest.mark.parametrize("task_id", LEARN_HARD)
async def test_two_cells_of_a_10x10_grid_solve_each_learn_hard_task(genv, gym, http, task_id):
    # The family's scripted difficulty: one tap on a random cell of the finer grid solves it with
    # probability 2/100 (the two cells of row 1 whose centres, x 270 and 306, lie on the switch).
    assert await solving_cells(genv, gym, http, task_id, GRID10) == [17, 18]


LEARN_LONG = {"sim-021-learn-long-setup-trap2": 2, "sim-022-learn-long-setup-trap3": 3}


@pytest.mark.parametrize("task_id", sorted(LEARN_LONG))
async def test_each_learn_long_page_moves_by_its_grid_row(genv, gym, http, task_id):
    # From each page of the wizard, each cell of the 3x3 grid on a fresh execution: the middle
    # row goes one page on (the last page: done), the top row one page back (page 1: nowhere),
    # the bottom row nowhere, except on the trap page, where it erases everything. Pages reached
    # by Next taps; the screen after each tap read from the action answer.
    trap = LEARN_LONG[task_id]
    for page in (1, 2, 3, 4):
        for cell, (x, y) in enumerate(GRID):
            async with genv.execution(task_id) as ex:
                url = f"{gym.base_url}/executions/{ex.execution_id}/actions"
                for _ in range(page - 1):
                    r = await http.post(url, json={"name": "tap", "args": {"x": 180, "y": 320}})
                    assert r.status_code == 200, r.text
                r = await http.post(url, json={"name": "tap", "args": {"x": x, "y": y}})
                answer = r.json()
            if cell < 3:
                want = f"setup{max(page - 1, 1)}"
            elif cell < 6:
                want = f"setup{page + 1}" if page < 4 else "setup_done"
            else:
                want = "setup_erased" if page == trap else f"setup{page}"
            assert answer["screen"] == want, (page, cell, answer)
            # The phone names the state an action started from and the one it left.
            moved = want != f"setup{page}"
            assert (answer["state_key_before"] != answer["state_key_after"]) is moved


@pytest.mark.parametrize("task_id", sorted(LEARN_LONG))
async def test_erasing_is_a_dead_end(genv, gym, http, task_id):
    async with genv.execution(task_id) as ex:
        url = f"{gym.base_url}/executions/{ex.execution_id}/actions"
        for _ in range(LEARN_LONG[task_id] - 1):
            await http.post(url, json={"name": "tap", "args": {"x": 180, "y": 320}})
        erased = (await http.post(url, json={"name": "tap", "args": {"x": 60, "y": 533}})).json()
        assert erased["screen"] == "setup_erased"
        for x, y in GRID:
            r = (await http.post(url, json={"name": "tap", "args": {"x": x, "y": y}})).json()
            assert r["ok"] is False and r["screen"] == "setup_erased"
            assert r["state_key_before"] == r["state_key_after"] == erased["state_key_after"]
        assert (await ex.evaluate()).success is False
