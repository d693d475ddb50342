"""A run closes every episode it started before its processes stop, however it ends.

Each case runs ``make demo``'s launcher asynchronously (two steps of staleness, eight episodes in
flight, so a prefetched batch no step trains is in flight at the end) against a gym started
here, which outlives the run: afterwards the gym lists no live execution and the monitor's
database has no rollout or environment still open, none closed by the monitor's own safety net:
the rollouts the end cut short say ``run ended: drained``. The cases: a normal end; a machine kept busy
(two CPU-bound processes started when the last step begins) while the run ends; SIGTERM to the
launcher while step 2's episodes wait on a stalled evaluate; a fail-fast stop (direct mode with
an agent that returns no token data: every episode is rejected).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cua_rl.rollout.drain import DRAIN_REASON
from cua_rl.sim.gym import GymServer
from cua_rl.sim.gym_state import Fault
from tests.conftest import db_rows

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
ASYNC = (
    "rollout.max_head_offpolicyness=2",
    f"total_train_epochs={STEPS}",
    f"total_train_steps={STEPS}",
    "rollout.max_concurrent_rollouts=8",
)
CASES = {
    "completed": ((), 0),
    "busy": ((), 0),
    "sigterm": (("total_train_steps=20", "total_train_epochs=20"), 130),
    "failfast": (("endpoint.mode=direct", "failfast.window=9", "failfast.persist_s=0"), 3),
}


def _step_begun(db: Path, step: int) -> bool:
    if not db.exists():
        return False
    try:
        return bool(db_rows(db, "SELECT 1 FROM step WHERE step = ?", step))
    except sqlite3.OperationalError:  # not yet created, or locked by the monitor's write
        return False


def _wait(proc: subprocess.Popen, ready, what: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the demo ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.5)


def _burn() -> list[subprocess.Popen]:
    """Two CPU-bound processes: the two cores of this machine's kind, kept busy."""
    loop = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(2)]


def _act(case: str, proc: subprocess.Popen, gym: GymServer, db: Path) -> list[subprocess.Popen]:
    """What each case does while the demo runs; the processes it started."""
    if case == "busy":
        _wait(proc, lambda: _step_begun(db, STEPS), f"step {STEPS}")
        return _burn()
    if case == "sigterm":
        _wait(proc, lambda: _step_begun(db, 2), "step 2")
        # From now on every evaluate stalls, so the signal lands while episodes hold executions.
        gym.gym.config.faults["evaluate"] = Fault(latency_s=300)
        seen = gym.gym.counters["evaluations"]
        _wait(proc, lambda: gym.gym.counters["evaluations"] > seen, "stalled evaluate")
        proc.send_signal(signal.SIGTERM)
    return []


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("case", list(CASES))
def test_the_run_leaves_no_execution_and_no_open_record(case, tmp_path):
    overrides, expected_rc = CASES[case]
    run_dir, db = tmp_path / "demo", tmp_path / "demo" / "monitor.db"
    with GymServer() as gym:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cua_rl.app.demo", "--run-dir", str(run_dir), "--quiet",
             "--gym-url", gym.url, *ASYNC, *overrides],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        burners: list[subprocess.Popen] = []
        try:
            burners = _act(case, proc, gym, db)
            out, _ = proc.communicate(timeout=1200)
        finally:
            for p in burners:
                p.kill()
                p.wait()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        live = httpx.get(f"{gym.base_url}/executions", timeout=10).json()["executions"]
        gym.gym.config.faults.clear()
    assert proc.returncode == expected_rc, out[-5000:]
    assert live == [], (live, out[-5000:])
    open_records = {
        "rollout": db_rows(
            db, "SELECT rollout_id, status FROM rollout WHERE status NOT IN ('completed', "
            "'failed', 'cancelled')"
        ),
        "environment": db_rows(
            db, "SELECT rollout_id, status FROM environment WHERE status NOT IN "
            "('terminated', 'error')"
        ),
    }  # fmt: skip
    assert not any(open_records.values()), (open_records, out[-5000:])
    # Closed by the workers, not by the monitor's safety net (which closes what a terminal
    # training left open, with its own message): every record the end cut short says drained.
    by_monitor = {
        table: db_rows(
            db, f"SELECT rollout_id, status, status_message FROM {table} "
            "WHERE status_message LIKE 'closed by the monitor%'"
        )
        for table in ("rollout", "environment")
    }  # fmt: skip
    assert not any(by_monitor.values()), by_monitor
    not_drained = db_rows(
        db, "SELECT rollout_id, status_message FROM rollout WHERE status = 'cancelled' "
        "AND status_message IS NOT ?", DRAIN_REASON
    )  # fmt: skip
    assert not not_drained, not_drained
    drained = [line for line in out.splitlines() if line.startswith("[demo] drain: ")]
    assert not [line for line in drained if "left open" in line or "did not" in line], drained
    # Every drain that began ended in its summary: none was cut short by its runner's loop stopping.
    began = [line for line in drained if "the run is ending" in line]
    ended = [line for line in drained if "cancelled and closed in" in line]
    assert len(began) == len(ended), drained
    cancelled = db_rows(db, "SELECT COUNT(*) FROM rollout WHERE status = 'cancelled'")[0][0]
    if case == "sigterm":
        assert cancelled > 0 and drained, out[-5000:]
    print(f"{case}: rc={proc.returncode} cancelled rollouts={cancelled}; " + " | ".join(drained))
