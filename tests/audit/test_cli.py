"""``python -m cua_rl.audit --config configs/local.yaml ...`` as a user runs it, against a real gym.

The command reads the training's config; it prints a line per task and the flagged tasks, writes
the JSON report, records the audit in the config's monitor (here the embedded one, on a SQLite
file) and exits 1 when a task is flagged, 0 when none is. A training that leaves out flagged
tasks reads them from the report or from that monitor. SIGINT in the middle of an audit, while
the gym provably holds every open box's evaluation, stops it with every box terminated.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from cua_rl.app import config_load
from cua_rl.app.config import CUAConfig
from cua_rl.audit.flagged import select_unflagged
from cua_rl.errors import ConfigError
from cua_rl.sim.gym import Fault, GymServer, SimGymConfig
from cua_rl.tasks import load_tasks_gym
from tests.audit.conftest import PLANTED, REPO, audit_config
from tests.monitor.browser import Browser, login
from tests.monitor.conftest import MonitorProcess

pytestmark = pytest.mark.slow


def audit_command(tmp_path, gym_url: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "cua_rl.audit", *audit_config(tmp_path, gym_url, *overrides)]


def run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def planted_gym():
    with GymServer(SimGymConfig(task_files=[str(PLANTED)])) as server:
        yield server


def test_flagged_tasks_exit_1_with_a_report_a_monitor_record_and_a_page(planted_gym, tmp_path):
    db, out = tmp_path / "monitor.db", tmp_path / "audit.json"
    proc = run(
        audit_command(
            tmp_path,
            planted_gym.url,
            "gym.selection.task_names=[user-]",
            f"monitor.db_path={db}",
            f"audit.out={out}",
        )
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("auditing 6 tasks of gym 'sim' at http://127.0.0.1:")
    progress = [line for line in lines if line.startswith("[")]
    assert len(progress) == 6 and progress[-1].startswith("[6/6] ")
    assert "flagged tasks:" in lines
    summary = next(line for line in lines if line.startswith("audited "))
    assert summary.endswith(": 2 free reward, 1 rejects its own success, 1 flaky, 2 clean")
    assert "boxes terminated" in summary
    assert lines[-1] == f"report: {out}"

    report = json.loads(out.read_text())
    head = report["audit"]
    assert head["status"] == "completed" and head["tasks"] == head["audited"] == 6
    assert head["counts"] == {
        "free_reward": 2,
        "rejects_success": 1,
        "flaky": 1,
        "clean": 2,
        "unchecked": 0,
    }
    runs = sum(len(t["runs"]) for t in report["tasks"])
    assert head["executions"] == {
        "created": runs,
        "terminated": runs,
        "terminate_failed": 0,
        "open": 0,
    }
    assert head["settings"]["concurrency"] == 4  # configs/local.yaml's rollout bound
    by_task = {t["task_id"]: t for t in report["tasks"]}
    free = by_task["user-free-start"]["flags"][0]
    assert free["kind"] == "free_reward" and free["agent"] == "stop"
    assert free["validators"][0]["message"] == "wifi is True, want True"

    # The monitor holds the audit and its tasks: the API, and a page in a real browser.
    monitor = MonitorProcess(db, token="audit-token")
    monitor.start()
    try:
        headers = monitor.headers()
        audits = httpx.get(f"{monitor.base_url}/api/audits", headers=headers).json()["audits"]
        assert [(a["client_id"], a["status"], a["flagged"]) for a in audits] == [
            (head["id"], "completed", 4)
        ]
        one = httpx.get(f"{monitor.base_url}/api/audits/{audits[0]['id']}", headers=headers)
        verdicts = {t["task_id"]: t["verdict"] for t in one.json()["audit"]["tasks"]}
        assert verdicts == {t: v["verdict"] for t, v in by_task.items()}
        _page_shows_the_verdicts(tmp_path, monitor, audits[0]["id"])
    finally:
        monitor.stop()

    # A training with curriculum.skip_flagged leaves them out of what its selection picks: from
    # the report, or from the monitor.
    tasks = asyncio.run(_planted_tasks(planted_gym))
    flagged = {"user-free-start", "user-coin-flip", "user-wrong-field", "user-free-answer"}
    for source in (f"curriculum.audit_file={out}", f"monitor.db_path={db}"):
        config = _training_config(tmp_path, planted_gym, "curriculum.skip_flagged=true", source)
        split, line = select_unflagged(config, tasks)
        assert {t.id for t in split.train} == {"user-clean-wifi", "user-clean-note"}
        assert line.startswith("audit: leaving out 4 flagged of the 6 selected tasks: ")
        assert all(t in line for t in flagged)
    config = _training_config(
        tmp_path, planted_gym, "curriculum.skip_flagged=true", f"monitor.db_path={db}",
        "gym.gym_id=other",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="holds no completed audit of gym 'other'"):
        select_unflagged(config, tasks)
    config = _training_config(
        tmp_path, planted_gym, "curriculum.skip_flagged=true", f"curriculum.audit_file={out}",
        "gym.selection.task_names=[user-free-start]",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="every train task the selection picks is flagged"):
        select_unflagged(config, tasks)


def _training_config(tmp_path, gym, *overrides: str):
    args = audit_config(tmp_path, gym.url, "gym.selection.task_names=[user-]", *overrides)
    return config_load.load_config(args, CUAConfig, write=False, needs_model=False)


async def _planted_tasks(gym):
    from cua_rl.clients.genv import GenvClient

    async with GenvClient(gym.url, gym.gym_id) as genv:
        return await load_tasks_gym(genv)


def _page_shows_the_verdicts(tmp_path, monitor, audit_id: int) -> None:
    browser = Browser(tmp_path / "profile")
    try:
        login(browser, monitor.base_url, monitor.token)
        page = browser.page
        page.goto(f"{monitor.base_url}/audits/{audit_id}")
        rows = page.locator("tr.audit-task")
        assert rows.count() == 6
        # Flagged tasks first, each with its verdict and the flag's evidence.
        assert rows.nth(0).locator(".verdict").inner_text() == "free reward"
        free = page.locator("tr.audit-task", has_text="user-free-start")
        assert "stopping at once is rewarded in 3 of 3 runs" in free.inner_text()
        assert page.locator("tr.audit-task.clean").count() == 2
        page.screenshot(path=str(tmp_path / "audit-page.png"), full_page=True)
        page.goto(f"{monitor.base_url}/audits")
        assert page.locator("tr.audit-row").count() == 1
        assert browser.problems == []
    finally:
        browser.close()


def test_clean_tasks_exit_0(planted_gym, tmp_path):
    proc = run(
        audit_command(
            tmp_path,
            planted_gym.url,
            "gym.selection.task_names=[user-clean-wifi,user-clean-note]",
            "monitor.enabled=false",
            "audit.agents=[stop,wait,replay]",
        )
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ": 2 clean" in proc.stdout
    assert "flagged tasks:" not in proc.stdout


def test_sigint_mid_audit_terminates_every_box(tmp_path):
    """The gym holds every evaluation (an injected latency far longer than the test waits): once
    it holds as many as the audit may open, SIGINT; the audit must terminate them all."""
    held = Fault(latency_s=30.0)
    config = SimGymConfig(task_files=[str(PLANTED)], faults={"evaluate": held})
    db, out = tmp_path / "monitor.db", tmp_path / "audit.json"
    with GymServer(config) as gym:
        cmd = audit_command(
            tmp_path,
            gym.url,
            f"monitor.db_path={db}",
            f"audit.out={out}",
            "rollout.max_concurrent_rollouts=3",
        )
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            deadline = time.monotonic() + 300
            while gym.gym.delaying.get("evaluate", 0) < 3:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "the audit never reached its evaluations"
                time.sleep(0.05)  # a poll of the gym's own count, not a bet on timing
            assert len(gym.gym.live) == 3
            proc.send_signal(signal.SIGINT)
            output, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 130, output
        assert gym.gym.live == {}
        counters = gym.gym.counters
        assert counters["terminated"] == counters["created"] >= 3
        assert counters["peak_live"] == 3
    assert "SIGINT: stopping; terminating the open boxes" in output
    report = json.loads(out.read_text())
    assert report["audit"]["status"] == "cancelled"
    assert report["audit"]["executions"]["open"] == 0
    assert report["audit"]["executions"]["terminate_failed"] == 0
    assert report["audit"]["audited"] < report["audit"]["tasks"]
