"""A trainer killed outright mid-step, for real: the monitor's safety net fails its training.

train.py (AReaL's PPOTrainer, the session's shared vLLM CPU server, the tiny Qwen2-VL) runs
against a monitor this test serves with a short heartbeat timeout, the local gym and the local
agent. Once a step's episode is running (read from the monitor's database), the trainer's process
group (AReaL's workers, and the hold on the borrowed server with them) gets SIGKILL: nothing of
the run can close anything. After
the timeout the monitor has marked the training failed ("heartbeat lost") and closed every record
under it.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from cua_rl.sim.agent import AgentServer
from cua_rl.sim.gym import GymServer, SimGymConfig
from tests.conftest import NO_EVAL, db_rows, note_cost, train_command

from .conftest import MonitorProcess

ROOT = Path(__file__).resolve().parents[2]
# Eight of the trainer's heartbeats (monitor.heartbeat_s below): a live trainer on a loaded
# machine is not reaped, and the test does not wait out the default 30 s beats.
HEARTBEAT_S = 5
TIMEOUT_S = 40

pytestmark = pytest.mark.slow


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the trainer's process group: AReaL's workers and the vLLM server are in it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


def _wait_for(db: Path, sql: str, timeout: float, proc=None, log: Path | None = None) -> None:
    """Polls the monitor's database until ``sql`` returns a row (state, not time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise AssertionError(
                f"the trainer exited {proc.returncode} before the step ran:\n{tail}"
            )
        try:
            if db.exists() and db_rows(db, sql):
                return
        except sqlite3.Error:  # a write holds the lock: ask again
            pass
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout} s waiting for: {sql}")


@pytest.mark.timeout(1500)
def test_a_trainer_killed_mid_step_leaves_a_failed_training_with_nothing_open(
    tmp_path, tiny_vl_bpe_model_dir, model_servers
):
    db = tmp_path / "monitor.db"
    server = model_servers("qwen2-vl-bpe")
    # The run's temporary folder, as a lost node's /tmp: what the killed processes leave there
    # (their warm-start zygote's socket folder) nothing of the run can remove. A short path:
    # the zygote's Unix socket goes in it.
    node_tmp = tempfile.mkdtemp(prefix="cua-killed-")
    t0 = time.monotonic()
    monitor = MonitorProcess(db, token=None, extra_args=("--heartbeat-timeout-s", str(TIMEOUT_S)))
    monitor.start()
    proc = None
    try:
        with (
            GymServer(SimGymConfig()) as gym,
            AgentServer() as agent,
            open(tmp_path / "train.log", "wb") as log,
        ):
            proc = subprocess.Popen(
                train_command(
                    tiny_vl_bpe_model_dir, gym.url, agent.url,
                    f"monitor.base_url={monitor.base_url}", tmp_path, server.borrow_override(),
                    *NO_EVAL, "total_train_steps=50", "total_train_epochs=50",
                    f"monitor.heartbeat_s={HEARTBEAT_S}",
                ),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "TMPDIR": node_tmp},
            )  # fmt: skip
            running = "SELECT 1 FROM rollout WHERE source_type = 'step' AND status = 'running'"
            _wait_for(db, running, 900, proc, tmp_path / "train.log")
            _kill(proc)
            open_before = db_rows(
                db, "SELECT COUNT(*) FROM rollout WHERE status IN ('pending', 'running')"
            )[0][0]
            _wait_for(db, "SELECT 1 FROM training WHERE status = 'failed'", TIMEOUT_S * 3)
    finally:
        if proc is not None and proc.poll() is None:
            _kill(proc)
        monitor.stop()
        left_in_tmp = sorted(p.name for p in Path(node_tmp).iterdir())
        shutil.rmtree(node_tmp, ignore_errors=True)
    note_cost("trainer killed", time.monotonic() - t0)
    print(f"left in the killed run's temporary folder: {left_in_tmp}")
    assert open_before > 0  # the kill left open records: the safety net had work to do
    ((status, message),) = db_rows(db, "SELECT status, status_message FROM training")
    assert status == "failed" and message.startswith("heartbeat lost: silent for"), message
    open_rows = {
        "rollout": db_rows(db, "SELECT id, status FROM rollout WHERE status NOT IN "
                               "('completed', 'failed', 'cancelled')"),
        "environment": db_rows(db, "SELECT id, status FROM environment WHERE status NOT IN "
                                   "('terminated', 'error')"),
        "step": db_rows(db, "SELECT step, status FROM step WHERE status NOT IN "
                            "('completed', 'failed')"),
    }  # fmt: skip
    assert not any(open_rows.values()), open_rows
    closed = db_rows(
        db,
        "SELECT COUNT(*) FROM status_history WHERE entity_type = 'rollout' "
        "AND new_status = 'cancelled' AND status_message LIKE '%heartbeat lost%'",
    )[0][0]
    assert closed > 0
    print(f"open rollouts at the kill: {open_before}; closed for heartbeat lost: {closed}")
