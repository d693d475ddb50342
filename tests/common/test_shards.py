"""``make test``'s runner (scripts/test_shards.py) and the suite's budget of whole trainings.

Read from the test files' source, not by running them: every test that reads a shared training
runs in the process that trains it (else a second process would train it again), every group
names files and tests that exist, and every test file that starts a whole training records its
cost where the runner prints it (``note_cost``, or ``run_demo`` which calls it). The runner's
reports are read back from a JUnit file and a costs file written by hand.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# The fixtures that give a test a shared training (tests/conftest.py).
SHARED = {"shared_training", "demo_run", "function_training"}
# What a whole training is started with: the launcher, make demo's and make learn's, AReaL's smoke.
LAUNCHERS = ("examples.cua_agent.train", "cua_rl.app.demo", "cua_rl.app.learn", "cua_rl.cpu.smoke")
# Files that run a launcher only to see it stop before any training starts (a config error,
# --help, --check, an unreachable service, an import check): seconds, not a training.
STOPS_BEFORE_TRAINING = {
    "tests/app/test_config_load.py",
    "tests/app/test_controls.py",
    "tests/app/test_harness.py",
    "tests/app/test_launch_errors.py",
    "tests/app/test_service_errors.py",
    "tests/app/test_usage.py",
    "tests/common/test_harness_imports.py",
    "tests/cpu/test_warm_start.py",  # the launcher as a zygote's stand-in, and a config error
    "tests/inference/test_gpu_recipe.py",  # reads the recipe's commands, runs make -n
}


def _runner():
    spec = importlib.util.spec_from_file_location("test_shards", ROOT / "scripts/test_shards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if p.name != "test_shards.py")


def _fixture_users(tree: ast.Module) -> dict[str, set[str]]:
    """Every test function and fixture of a module with the fixtures it takes by name."""
    return {
        node.name: {a.arg for a in node.args.args}
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def _readers_of_shared_trainings() -> set[str]:
    """Node ids (file::test) of the tests that read a shared training, directly or through a
    fixture of their module."""
    found = set()
    for path in _test_files():
        users = _fixture_users(ast.parse(path.read_text()))
        shared = {name for name, args in users.items() if args & SHARED}
        for name, args in users.items():
            if name.startswith("test_") and (args & SHARED or args & shared):
                found.add(f"{path.relative_to(ROOT)}::{name}")
    return found


def _group_of(node: str, beside: dict[str, tuple[str, ...]]) -> str:
    for group, paths in beside.items():
        for p in paths:
            if node == p or node.startswith(p.rstrip("/") + ("::" if p.endswith(".py") else "/")):
                return group
    return "main"


def test_every_test_reading_a_shared_training_runs_in_one_process():
    beside = _runner().BESIDE
    readers = _readers_of_shared_trainings()
    assert readers  # the scan finds them (the demo's own tests at least)
    groups = {node: _group_of(node, beside) for node in readers}
    assert set(groups.values()) == {"shared"}, {n: g for n, g in groups.items() if g != "shared"}


def test_every_group_names_files_and_tests_that_exist():
    for group, paths in _runner().BESIDE.items():
        for p in paths:
            file, _, test = p.partition("::")
            assert (ROOT / file).exists(), (group, p)
            if test:
                tree = ast.parse((ROOT / file).read_text())
                assert test in _fixture_users(tree), (group, p)


def test_every_file_that_starts_a_training_records_its_cost():
    silent = [
        str(path.relative_to(ROOT))
        for path in _test_files()
        if any(launcher in path.read_text() for launcher in LAUNCHERS)
        and _starts_a_process(path)
        and not {"note_cost", "run_demo"} & _names(path)
        and str(path.relative_to(ROOT)) not in STOPS_BEFORE_TRAINING
    ]
    assert silent == [], f"whole trainings not in the runner's budget (note_cost): {silent}"


def _names(path: Path) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}


def _starts_a_process(path: Path) -> bool:
    """Whether the file runs a launcher (subprocess or ``train_command``), not only names one."""
    calls = {
        (n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", ""))
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Call)
    }
    return bool(calls & {"run", "Popen", "train_command", "run_demo"})


def test_the_runner_reports_the_slowest_tests_and_every_training(tmp_path, capsys):
    runner = _runner()
    junit = tmp_path / "junit-main.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.app.test_a" name="test_slow" time="120.5"/>'
        '<testcase classname="tests.app.test_a" name="test_fast" time="0.1"/>'
        "</testsuite></testsuites>"
    )
    other = tmp_path / "junit-shared.xml"
    other.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.app.test_b" name="test_mid[x]" time="30"/>'
        "</testsuite></testsuites>"
    )
    assert runner.slowest({"main": junit, "shared": other, "none": tmp_path / "absent"}, 2) == [
        (120.5, "tests/app/test_a.py::test_slow", "main"),
        (30.0, "tests/app/test_b.py::test_mid[x]", "shared"),
    ]
    costs = tmp_path / "costs-shared.jsonl"
    costs.write_text(
        "\n".join(
            json.dumps(r)
            for r in (
                {"name": "shared demo", "kind": "training", "seconds": 200.0, "cpu_seconds": 90},
                {
                    "name": "shared vLLM server qwen2-vl-bpe",
                    "kind": "server",
                    "seconds": 50.0,
                    "cpu_seconds": 60.0,
                },
                {"name": "model outage", "kind": "training", "seconds": 100.5, "cpu_seconds": 40},
                {"name": "tests/a.py::cheap", "kind": "test", "seconds": 9.0, "cpu_seconds": 1},
                {"name": "tests/a.py::dear", "kind": "test", "seconds": 5.0, "cpu_seconds": 7},
            )
        )
    )
    runner.print_costs({"shared": costs, "main": tmp_path / "absent.jsonl"})
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        "[tests] whole trainings: 2, 300 s, 130 CPU s in all; shared vLLM servers: 1, started in "
        "50 s, 60 CPU s (budget: tests/README.md)"
    )
    # Most CPU first: on two busy cores it is the cost that adds up.
    assert [line.split("  ")[-2] for line in out[2:5]] == [
        "shared demo",
        "shared vLLM server qwen2-vl-bpe",
        "model outage",
    ]
    assert "200.0 s    90.0 CPU s" in out[2], out[2]
    # Then the tests, most CPU first, apart from the trainings.
    assert out[5:] == [
        "",
        "[tests] the 2 costliest of 2 tests in CPU seconds (8 CPU s in all; a shared training's "
        "or server's on the first test that asks for it):",
        "[tests]     7.0 CPU s     5.0 s  tests/a.py::dear  (shared)",
        "[tests]     1.0 CPU s     9.0 s  tests/a.py::cheap  (shared)",
    ]


def test_a_test_named_in_one_group_runs_in_that_group_only():
    runner = _runner()
    beside = {
        "a": ("tests/x/test_f.py", "tests/y"),
        "b": ("tests/x/test_f.py::test_slow", "tests/z/test_g.py"),
    }
    assert runner.selections(beside) == {
        "main": [
            "--ignore=tests/x/test_f.py",
            "--ignore=tests/y",
            "--deselect=tests/x/test_f.py::test_slow",
            "--ignore=tests/z/test_g.py",
        ],
        "a": ["tests/x/test_f.py", "tests/y", "--deselect=tests/x/test_f.py::test_slow"],
        "b": ["tests/x/test_f.py::test_slow", "tests/z/test_g.py"],
    }


def test_a_file_or_test_named_in_one_group_is_left_out_of_anothers_folder():
    runner = _runner()
    beside = {
        "a": ("tests/x", "tests/xy/test_h.py"),
        "b": ("tests/x/test_f.py", "tests/x/sub/test_g.py::test_one", "tests/xy"),
    }
    selected = runner.selections(beside)
    # tests/xy is not inside tests/x: a name that only starts like the folder stays.
    assert selected["a"] == [
        "tests/x",
        "tests/xy/test_h.py",
        "--ignore=tests/x/test_f.py",
        "--deselect=tests/x/sub/test_g.py::test_one",
    ]
    assert selected["b"] == [*beside["b"], "--ignore=tests/xy/test_h.py"]


def test_each_test_of_a_costed_run_records_its_cpu_seconds(tmp_path):
    """tests/conftest.py writes one record per test where the runner asks for costs: the test's
    node id, its wall and CPU seconds (this process's tree, sampled at its start and end)."""
    costs = tmp_path / "costs.jsonl"
    chosen = [
        "tests/common/test_shards.py::test_a_test_named_in_one_group_runs_in_that_group_only",
        "tests/common/test_shards.py::test_every_group_names_files_and_tests_that_exist",
    ]
    env = {**os.environ, "CUA_TEST_COSTS": str(costs)}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *chosen],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    records = [json.loads(line) for line in costs.read_text().splitlines()]
    assert [(r["kind"], r["name"]) for r in records] == [("test", name) for name in chosen]
    assert all(r["cpu_seconds"] >= 0 and r["seconds"] >= 0 for r in records), records


@pytest.fixture
def main_stand_in():
    """A process standing in for main's pytest process: it waits on its stdin until the test ends."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    yield child
    child.communicate(b"")


def test_the_main_process_gets_its_nice_value_and_the_session_group_gets_it_back(
    tmp_path, capsys, main_stand_in
):
    """The runner gives main's pytest process a nice value and its session's scheduling group
    the same, and afterwards puts the group's value back (the session outlives the run). A
    higher nice value needs no privilege; the group is a file standing in for /proc's."""
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-7 nice 0\n")
    restore = _runner().prioritise(main_stand_in.pid, 4, autogroup=group)
    assert os.getpriority(os.PRIO_PROCESS, main_stand_in.pid) == 4
    assert group.read_text() == "4\n"
    restore()
    assert group.read_text() == "0\n"
    assert "the main process runs at nice 4" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["", "nice\n"])
def test_a_group_file_without_a_value_leaves_the_group_and_still_sets_the_nice_value(
    tmp_path, capsys, text, main_stand_in
):
    """CI's sandbox serves /proc/self/autogroup empty: the runner sets main's nice value, says
    the group keeps its own, and its restore writes nothing."""
    group = tmp_path / "autogroup"
    group.write_text(text)
    restore = _runner().prioritise(main_stand_in.pid, 4, autogroup=group)
    assert os.getpriority(os.PRIO_PROCESS, main_stand_in.pid) == 4
    restore()
    assert group.read_text() == text
    out = capsys.readouterr().out
    assert "the main process runs at nice 4" in out
    assert "the session's scheduling group keeps its value" in out


def test_a_group_that_cannot_be_put_back_is_said_and_the_run_goes_on(
    tmp_path, capsys, main_stand_in
):
    """Putting the group's value back runs after the tests: where the write fails, the runner
    says how to do it by hand instead of raising over the tests' outcome."""
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-7 nice 2\n")
    restore = _runner().prioritise(main_stand_in.pid, 4, autogroup=group)
    group.unlink()
    group.mkdir()  # writing a directory fails whatever the user's privileges
    restore()
    assert "stays at nice 4" in capsys.readouterr().out


def test_a_nice_value_that_cannot_be_set_is_said_and_changes_nothing(tmp_path, capsys):
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-7 nice 0\n")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no process now
    _runner().prioritise(gone.pid, 4, autogroup=group)()
    assert group.read_text() == "/autogroup-7 nice 0\n"
    assert "the main process keeps its priority (CUA_TEST_MAIN_NICE=4" in capsys.readouterr().out
