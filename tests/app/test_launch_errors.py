"""A launch reports what ``--check`` reports, as the same ``config error:`` line, before anything
starts; ``--check`` reports every config problem of a run at once, each blamed on where it was set.

The launches are the real entry point in a process of its own (``python -m
examples.cua_agent.train``), with the local gym, the local agent and a monitor on loopback
running, as a user would have them: a mistake must not reach AReaL (a transformers traceback
minutes later) nor the monitor (a ``failed`` training recorded for a run that never started).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cua_rl.app import train
from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.serving import ThreadedServer, bind_free_port
from cua_rl.sim.agent import AgentServer
from cua_rl.sim.gym import GymServer

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "configs" / "local.yaml"


def _launch(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "examples.cua_agent.train", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _runs(tmp_path: Path) -> list[str]:
    return [f"cluster.fileroot={tmp_path / 'runs'}"]


def test_a_missing_model_folder_at_launch_is_one_line_and_no_training(tmp_path):
    """The gym, the agent and the monitor answer; actor.path names no folder. The launch used
    to record a training, start AReaL and end in 94 lines of traceback, exit 1, with the
    training ``failed`` in the monitor; now: --check's line, exit 2, nothing recorded or
    written."""
    store = MonitorStore(str(tmp_path / "m.db"))
    missing = tmp_path / "no-such-model"
    try:
        with (
            GymServer() as gym,
            AgentServer() as agent,
            ThreadedServer(create_app(store)) as monitor,
        ):
            proc = _launch(
                "--config", str(LOCAL), *_runs(tmp_path), f"actor.path={missing}",
                f"gym.base_url={gym.url}", f"agent.base_url={agent.url}",
                f"monitor.base_url={monitor.url}",
            )  # fmt: skip
            trainings = httpx.get(f"{monitor.url}/api/trainings").json()["trainings"]
    finally:
        store.close()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"config error: actor.path={missing}: no such folder: point actor.path at the policy's "
        "checkpoint folder (a Hugging Face folder with config.json and *.safetensors), or at a "
        f"hub id such as org/name (command line: actor.path={missing})"
    ]
    assert not proc.stdout.strip(), proc.stdout
    assert trainings == []
    assert not (tmp_path / "runs").exists()


def test_check_prints_the_launchs_line_for_the_same_mistake(tmp_path, capsys):
    """``--check`` and the launch load alike (``launch=True``): the same line, exit 2."""
    missing = tmp_path / "no-such-model"
    argv = ["--config", str(LOCAL), *_runs(tmp_path), f"actor.path={missing}"]
    assert train.main([*argv, "--check"]) == 2
    checked = capsys.readouterr().err
    assert train.main(argv) == 2
    launched = capsys.readouterr().err
    assert checked == launched and checked.startswith("config error: actor.path=")


def test_check_finds_in_one_run_what_took_two(tmp_path, tiny_vl_model_dir, capsys):
    """A section's own check (agent.context, monitor.store_episodes: each raised alone while
    the config built, after the table's rows had passed) beside a row of the table, and a
    model folder that is not there beside both: one run, one line each, each blamed on the
    command line that set it."""
    rc = train.main(
        [
            "--config", str(LOCAL), "--check", *_runs(tmp_path),
            f"actor.path={tmp_path / 'absent'}", "actor.optimizer.lr=-1",
            "agent.context=maiui", "monitor.store_episodes=some",
        ]
    )  # fmt: skip
    lines = capsys.readouterr().err.splitlines()
    assert rc == 2
    assert len(lines) == 4, lines
    for key in ("actor.path", "actor.optimizer.lr", "agent.context", "monitor.store_episodes"):
        (line,) = [ln for ln in lines if ln.startswith(f"config error: {key}=")]
        assert f"(command line: {key}=" in line, line
    (context,) = [ln for ln in lines if "agent.context" in ln]
    assert "use one of full, mai-ui, current" in context


def test_a_misspelt_file_key_is_one_line_without_a_follow_on(tmp_path, tiny_vl_model_dir, capsys):
    """``max_concurent_rollouts`` in the file leaves the real key unset: one line, the unknown
    key's with its correction, and no second one blaming the file for a key it does not set."""
    mine = tmp_path / "my.yaml"
    mine.write_text(
        LOCAL.read_text().replace("max_concurrent_rollouts: 4", "max_concurent_rollouts: 4")
    )
    argv = ["--config", str(mine), "--check", *_runs(tmp_path), f"actor.path={tiny_vl_model_dir}"]
    assert train.main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"config error: unknown key rollout.max_concurent_rollouts in {mine}; did you mean "
        "rollout.max_concurrent_rollouts?"
    ]
    # Without the misspelt key, the missing one is not blamed on the file either.
    mine.write_text(LOCAL.read_text().replace("max_concurrent_rollouts: 4", ""))
    assert train.main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("config error: rollout.max_concurrent_rollouts=null must be > 0")
    assert line.endswith(f"(not set in {mine} nor on the command line)"), line


def test_a_key_given_twice_is_blamed_on_the_value_that_failed(tmp_path, tiny_vl_model_dir, capsys):
    """The demo passes agent.mode=service and the user's DEMO_ARGS agent.mode=<bad> after it:
    the line quotes the value that failed (Hydra's last), not the one it overrode."""
    rc = train.main(
        [
            "--config", str(LOCAL), "--check", *_runs(tmp_path),
            f"actor.path={tiny_vl_model_dir}", "agent.mode=service", "agent.mode=bad",
        ]
    )  # fmt: skip
    (line,) = capsys.readouterr().err.splitlines()
    assert rc == 2
    assert line.startswith("config error: agent.mode='bad' must be one of")
    assert line.endswith("(command line: agent.mode=bad)"), line


def test_a_missing_config_file_is_reported_before_the_heavy_imports():
    """It took 18 s (AReaL and torch imported first); the entry point now answers before
    importing them: checked by what was imported, not by a clock."""
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('imported:', 'torch' in sys.modules, 'areal' in "
        "sys.modules, file=sys.stderr))\n"
        "import runpy\n"
        "sys.argv = ['train', '--config', 'no-such.yaml', '--check']\n"
        "runpy.run_module('examples.cua_agent.train', run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "config error: --config no-such.yaml: no such file",
        "imported: False False",
    ]


@pytest.fixture
def dead_url():
    # A bound but never-listening socket: connections are refused for the test's duration.
    sock = bind_free_port()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_check_lines_for_unreachable_services_say_the_fix_and_stand_alone(
    tmp_path, dead_url, tiny_vl_model_dir
):
    """The gym's retries (three attempts) used to print INFO lines among the table's; the agent's
    and the monitor's lines said ``unreachable`` with no fix. As a user runs it."""
    proc = _launch(
        "--config", str(LOCAL), "--check", *_runs(tmp_path), f"actor.path={tiny_vl_model_dir}",
        f"gym.base_url={dead_url}", f"agent.base_url={dead_url}", f"monitor.base_url={dead_url}",
        # No inference server to probe (its line fails at once): not what this is about.
        f"inference.python={tmp_path / 'no-python'}",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "attempt" not in proc.stderr and " INFO " not in proc.stderr, proc.stderr
    lines = {ln.split()[1]: ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL")}
    assert {"gym", "agent", "monitor"} <= set(lines), proc.stdout
    assert "fix the host and port of gym.base_url" in lines["gym"]
    assert "start the agent service" in lines["agent"] and "agent.base_url" in lines["agent"]
    assert "start the monitor" in lines["monitor"] and "monitor.base_url" in lines["monitor"]
