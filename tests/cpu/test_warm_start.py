"""Warm worker starts (cua_rl/cpu/warm_start.py): the stand-in ``python -m cua_rl.cpu.rpc_worker``
as AReaL's scheduler starts it, a real zygote, and a worker entry of this folder
(``warm_entry.py``) in place of AReaL's RPC server. The trainings of the suite run the real
entry (app/test_train_local.py checks that their workers were forked)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from cua_rl.cpu.warm_start import (
    ENV_TRAINER_ZYGOTE,
    ENV_ZYGOTE,
    WarmStartError,
    Zygote,
    start_workers_warm,
)

ROOT = Path(__file__).resolve().parents[2]
ENTRY = "tests.cpu.warm_entry:run"
STAND_IN = [sys.executable, "-m", "cua_rl.cpu.rpc_worker", "--role", "actor", "--port", "1"]


@pytest.fixture
def zygote():
    z = Zygote(preload=("json", "numpy"), entry=ENTRY).start()
    yield z
    z.stop()
    assert z.proc.returncode == 0
    assert not Path(z.address).parent.exists()


def _env(zygote: Zygote, **extra: str) -> dict[str, str]:
    return {**os.environ, ENV_ZYGOTE: zygote.address, **extra}


def _start(zygote: Zygote, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        STAND_IN, cwd=ROOT, env=_env(zygote, **extra), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _line_starting(proc: subprocess.Popen, prefix: str) -> str:
    for line in proc.stdout:
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"no line starting {prefix!r}: exit {proc.wait()}, {proc.stderr.read()}")


def test_a_forked_worker_gets_the_stand_ins_arguments_environment_and_streams(zygote):
    first = _start(zygote, WARM_TEST="report", WARM_VALUE="a")
    out, err = first.communicate("from stdin\n", timeout=120)
    assert first.returncode == 0, err
    forked = next(
        line for line in out.splitlines() if line.startswith("[warm-start] worker forked")
    )
    seen = json.loads(out.splitlines()[-1])
    assert forked.endswith(f"pid {seen['pid']}")
    # The zygote's child, not the stand-in's, with everything of the stand-in's.
    assert seen["ppid"] == zygote.proc.pid != first.pid
    assert seen["argv"] == [str(ROOT / "cua_rl" / "cpu" / "rpc_worker.py"), *STAND_IN[3:]]
    assert (seen["cwd"], seen["env"], seen["stdin"]) == (str(ROOT), "a", "from stdin")
    assert seen["sigterm"] == str(signal.SIG_DFL)
    # Its command line is the stand-in's (what ps, psutil and the run's checks read).
    assert seen["cmdline"] == [sys.executable, *STAND_IN[1:]]
    assert err.strip().endswith("to stderr")
    # A second worker: another fork, other random draws (both generators reseeded).
    second = _start(zygote, WARM_TEST="report", WARM_VALUE="a")
    out2, _ = second.communicate("\n", timeout=120)
    again = json.loads(out2.splitlines()[-1])
    assert again["pid"] != seen["pid"]
    assert again["random"] != seen["random"] and again["np"] != seen["np"]


def test_workers_start_as_the_first_worker_would_have_started_cold(zygote, tmp_path):
    # The zygote execs itself in the first worker's environment before it imports: what acts
    # when a process starts (here the hash seed AReaL's seeding sets) is the worker's.
    first = _start(zygote, WARM_TEST="report", PYTHONHASHSEED="123")
    out, err = first.communicate("\n", timeout=120)
    assert first.returncode == 0, err
    cold = subprocess.run(
        [sys.executable, "-c", "print(hash('warm'))"], env={**os.environ, "PYTHONHASHSEED": "123"},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert json.loads(out.splitlines()[-1])["hash"] == int(cold)
    assert zygote.proc.poll() is None and not list(Path(zygote.address).parent.glob("*.json"))
    # Another seed, another directory: a fork could honour neither.
    assert _ask(zygote, WARM_TEST="report", PYTHONHASHSEED="124")[0].endswith(
        "differs from the first worker's in PYTHONHASHSEED"
    )
    assert _ask(zygote, cwd=tmp_path, WARM_TEST="report", PYTHONHASHSEED="123") == [
        "[warm-start] cold start: its working directory differs from the first worker's",
        "returned None",
    ]


@pytest.mark.parametrize(
    ("what", "code"), [({"WARM_CODE": "3"}, 3), ({"WARM_CODE": "0"}, 0)], ids=["3", "0"]
)
def test_the_stand_in_exits_with_the_workers_code(zygote, what, code):
    proc = _start(zygote, WARM_TEST="exit", **what)
    proc.communicate(timeout=120)
    assert proc.returncode == code


def test_a_worker_that_raises_prints_its_traceback_and_exits_1(zygote):
    proc = _start(zygote, WARM_TEST="raise")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "RuntimeError: the worker's bug" in err


def test_sigterm_to_the_stand_in_reaches_the_worker(zygote):
    proc = _start(zygote, WARM_TEST="wait-for-sigterm")
    _line_starting(proc, "ready ")  # its handler is installed
    proc.send_signal(signal.SIGTERM)
    assert _line_starting(proc, "got signal") == f"got signal {int(signal.SIGTERM)}"
    assert proc.wait(timeout=60) == 7


def test_a_worker_killed_by_a_signal_ends_its_stand_in_by_that_signal(zygote):
    proc = _start(zygote, WARM_TEST="wait")
    pid = int(_line_starting(proc, "ready ").split()[1])
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def test_a_killed_stand_in_takes_its_worker_with_it(zygote):
    proc = _start(zygote, WARM_TEST="wait")
    worker = psutil.Process(int(_line_starting(proc, "ready ").split()[1]))
    proc.kill()
    proc.wait()
    # The worker sees its connection close and kills itself (the bound is for failure only).
    worker.wait(timeout=60)


def test_a_killed_stand_in_takes_what_its_worker_started_with_it(zygote):
    # As a kill of a cold worker's process group would: the fork leads a group of its own.
    proc = _start(zygote, WARM_TEST="wait-with-child")
    _, pid, child = _line_starting(proc, "ready ").split()
    worker, grandchild = psutil.Process(int(pid)), psutil.Process(int(child))
    assert os.getpgid(worker.pid) == worker.pid == os.getpgid(grandchild.pid)
    proc.kill()
    proc.wait()
    worker.wait(timeout=60)
    grandchild.wait(timeout=60)


TRAINER = [sys.executable, "-m", "examples.cua_agent.train", "--config", "configs/local.yaml"]


@pytest.fixture
def trainer_zygote():
    z = Zygote(preload=("json",), entry=ENTRY, late=frozenset(), role="trainer").start()
    yield z
    z.stop()


def _launch(zygote: Zygote, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        TRAINER, cwd=ROOT, env={**os.environ, ENV_TRAINER_ZYGOTE: zygote.address, **extra},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_the_launcher_stands_in_for_a_fork_of_the_trainer_zygote(trainer_zygote):
    first = _launch(trainer_zygote, WARM_TEST="report", WARM_VALUE="t")
    out, err = first.communicate("from stdin\n", timeout=120)
    assert first.returncode == 0, err
    forked = [line for line in out.splitlines() if line.startswith("[warm-start] trainer forked")]
    seen = json.loads(out.splitlines()[-1])
    assert forked == [f"[warm-start] trainer forked from the zygote: pid {seen['pid']}"], out
    assert seen["ppid"] == trainer_zygote.proc.pid
    assert seen["argv"] == [str(ROOT / "examples" / "cua_agent" / "train.py"), *TRAINER[3:]]
    assert (seen["env"], seen["stdin"]) == ("t", "from stdin")
    # Another environment: the launcher runs cold, saying why, as it would run without a
    # zygote (here: the real launcher, stopped by a key its config lacks).
    other = subprocess.run(
        [*TRAINER, "no_such_section.key=1"], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, ENV_TRAINER_ZYGOTE: trainer_zygote.address, "WARM_TEST": "report",
             "WARM_VALUE": "u"},
        timeout=300,
    )  # fmt: skip
    assert other.stdout.splitlines()[0] == (
        "[warm-start] cold start: its environment differs from the first trainer's in WARM_VALUE"
    ), other.stdout
    assert other.returncode == 2 and "no_such_section" in other.stderr, other.stderr


def test_a_forked_trainer_waits_for_its_threads_before_it_exits(trainer_zygote):
    proc = _launch(trainer_zygote, WARM_TEST="thread")
    assert _line_starting(proc, "entry returned") == "entry returned"
    out, err = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0, err
    assert out.splitlines() == ["thread done"], out


def test_a_worker_whose_environment_differs_starts_cold_naming_the_variables(zygote):
    first = _start(zygote, WARM_TEST="exit", WARM_CODE="0")
    first.communicate(timeout=120)
    assert _ask(zygote, WARM_TEST="exit", WARM_CODE="0", OTHER="1") == [
        "[warm-start] cold start: its environment differs from the first worker's in OTHER",
        "returned None",
    ]


def _ask(zygote: Zygote, cwd: Path = ROOT, **extra: str) -> list[str]:
    """What ``run_forked`` prints and answers for a worker with this environment (None: the
    stand-in would run the worker itself)."""
    probe = textwrap.dedent("""
        import os, sys
        from cua_rl.cpu.warm_start import ENV_ZYGOTE, run_forked
        print("returned", run_forked(sys.argv, os.environ[ENV_ZYGOTE]))
    """)
    return subprocess.run(
        [sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**_env(zygote, **extra), **({} if cwd == ROOT else {"PYTHONPATH": str(ROOT)})},
    ).stdout.splitlines()  # fmt: skip


def test_a_late_variable_may_differ_unless_an_import_read_it():
    # The rollout worker's CUA_INFERENCE_SERVER is one such: the actor has none.
    z = Zygote(
        preload=("json", "numpy", "tests.cpu.warm_entry"), entry=ENTRY,
        late=frozenset({"WARM_LATE", "WARM_AT_IMPORT"}),
    ).start()  # fmt: skip
    try:
        outs = []
        for extra in ({"WARM_AT_IMPORT": "first"}, {"WARM_AT_IMPORT": "first", "WARM_LATE": "b"}):
            proc = _start(z, WARM_TEST="report", **extra)
            out, err = proc.communicate("\n", timeout=120)
            assert proc.returncode == 0, err
            outs.append(out.splitlines())
        assert outs[1][0].startswith("[warm-start] worker forked from the zygote")
        assert json.loads(outs[1][-1])["late"] == "b"
        # Read while the zygote imported: its value is the first worker's in every fork.
        assert _ask(z, WARM_TEST="report", WARM_AT_IMPORT="second") == [
            "[warm-start] cold start: its environment differs from the first worker's in "
            "WARM_AT_IMPORT (read while the zygote imported)",
            "returned None",
        ]
    finally:
        z.stop()


def test_a_zygote_that_cannot_import_fails_the_stand_in_with_the_reason(tmp_path):
    z = Zygote(preload=("json", "no_such_module_here"), entry=ENTRY).start()
    try:
        proc = subprocess.run(
            STAND_IN, cwd=ROOT, env=_env(z, WARM_TEST="exit", WARM_CODE="0"),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        z.stop()
    assert proc.returncode == 1
    assert "WarmStartError: the warm-start zygote could not start this worker" in proc.stderr
    assert "No module named 'no_such_module_here'" in proc.stderr


def test_a_stand_in_without_its_zygote_fails_naming_the_socket(tmp_path):
    missing = tmp_path / "gone.sock"
    proc = subprocess.run(
        STAND_IN, cwd=ROOT, env={**os.environ, ENV_ZYGOTE: str(missing)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert f"cannot reach the warm-start zygote at {missing}" in proc.stderr
    with pytest.raises(WarmStartError):
        from cua_rl.cpu.warm_start import run_forked

        run_forked(["x"], str(missing))


def test_the_zygote_and_its_workers_end_with_the_trainer_that_started_it(tmp_path):
    # A trainer stand-in: starts a zygote, a worker through it, then is killed outright.
    trainer = textwrap.dedent(f"""
        import os, subprocess, sys
        from cua_rl.cpu.warm_start import Zygote
        z = Zygote(preload=("json",), entry={ENTRY!r}).start()
        print("zygote", z.proc.pid, z.address, flush=True)
        env = {{**os.environ, "WARM_TEST": "wait"}}
        proc = subprocess.Popen({STAND_IN!r}, env=env, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if line.startswith("ready "):
                print(line.strip(), flush=True)
                break
        sys.stdin.read()
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", trainer], cwd=ROOT, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    _, pid, address = _line_starting(proc, "zygote ").split()
    zygote = psutil.Process(int(pid))
    worker = psutil.Process(int(_line_starting(proc, "ready ").split()[1]))
    proc.kill()
    proc.wait()
    # The zygote is told (SIGTERM at its parent's death), ends its worker, then itself, and
    # removes its socket's folder, which the dead trainer could not.
    worker.wait(timeout=60)
    zygote.wait(timeout=60)
    assert not Path(address).parent.exists(), address


def test_a_run_takes_the_zygote_its_environment_names_and_refuses_one_that_is_not_there(
    zygote, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(ENV_ZYGOTE, zygote.address)
    assert start_workers_warm(True) == zygote.address
    assert capsys.readouterr().out == (
        f"[warm-start] workers start from the zygote at {zygote.address} ({ENV_ZYGOTE})\n"
    )
    # warm_start_workers: false: its workers start cold, whatever the environment names.
    assert start_workers_warm(False) is None and ENV_ZYGOTE not in os.environ
    monkeypatch.setenv(ENV_ZYGOTE, str(tmp_path / "gone.sock"))
    with pytest.raises(WarmStartError, match="gone.sock: no zygote listens there"):
        start_workers_warm(True)
