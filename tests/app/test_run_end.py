"""A run closes every episode it started before its processes stop, however it ends.

Three ends, each against a gym started here, which outlives the run: afterwards the gym lists no
live execution and the monitor's database has no rollout or environment still open, none closed
by the monitor's own safety net: the rollouts the end cut short say ``run ended: drained``, and
every drain that began ended with its summary.

- A normal end on a machine kept busy: the session's shared demo run (``DEMO`` in
  tests/conftest.py: asynchronous, two steps of staleness, eight episodes in flight), with two
  CPU-bound processes from the start of its last step to its end. Whether a prefetched batch is
  still running when the run ends depends on the machine's speed (in one fresh-clone run all of
  it had finished), so this case asserts the drain ran (its line says what it closed, or that
  nothing was in flight) and that nothing was left open; the ends below put episodes in flight
  by construction, and the drain they exercise is the same one (the runner's destroy).
- SIGTERM to ``make demo``'s launcher while episodes wait on a stalled evaluate: the launcher
  stops train.py with a SIGTERM, as a scheduler sends it, and exits 130; train.py exits 143, the
  training is recorded cancelled, and every process either started is gone, the vLLM server
  included (this run starts its own).
- A fail-fast stop: an agent that returns no token data, called directly (no gateway), so every
  episode is rejected ``missing_tokens``; the run stops failed within the window, naming the
  reason and the fix, and exits 3.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cua_rl.rollout.drain import DRAIN_REASON
from cua_rl.sim.agent import AgentServer
from cua_rl.sim.gym import GymServer
from cua_rl.sim.gym_state import Fault
from cua_rl.testing.procs import descendants
from tests.conftest import NO_EVAL, NO_LATENCY, db_rows, note_cost, train_command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# The demo's asynchronous regime: batches prefetched two steps ahead, eight episodes at once.
ASYNC = ("rollout.max_head_offpolicyness=2", "rollout.max_concurrent_rollouts=8")
DRAIN_MARK = "cua_rl.rollout.drain: "


def _leftovers(marker: str) -> list[str]:
    """Processes whose command line names ``marker`` (the run folder): none may outlive a run."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited; only its parent's wait is missing


def _drain_lines(log_text: str) -> list[str]:
    return [line.split(DRAIN_MARK, 1)[1] for line in log_text.splitlines() if DRAIN_MARK in line]


def assert_everything_closed(db: Path, live: list, drained: list[str], what: str) -> int:
    """The run left no live execution and no open record, and closed them itself (drained),
    every drain to its summary; returns how many rollouts it cancelled."""
    assert live == [], (live, what)
    open_records = {
        "rollout": db_rows(
            db, "SELECT rollout_id, status FROM rollout WHERE status NOT IN ('completed', "
            "'failed', 'cancelled')"
        ),
        "environment": db_rows(
            db, "SELECT rollout_id, status FROM environment WHERE status NOT IN "
            "('terminated', 'error')"
        ),
        "baseline": db_rows(db, "SELECT status FROM baseline WHERE status NOT IN "
                                "('completed', 'failed', 'cancelled')"),
        "eval": db_rows(db, "SELECT status FROM eval WHERE status NOT IN "
                            "('completed', 'failed', 'cancelled')"),
    }  # fmt: skip
    assert not any(open_records.values()), (open_records, what)
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
    assert not [line for line in drained if "left open" in line or "did not" in line], drained
    # Every drain that began ended in its summary: none was cut short by its runner's loop stopping.
    began = [line for line in drained if "the run is ending" in line]
    ended = [line for line in drained if "cancelled and closed in" in line]
    assert len(began) == len(ended), drained
    return db_rows(db, "SELECT COUNT(*) FROM rollout WHERE status = 'cancelled'")[0][0]


@pytest.mark.timeout(1800)
def test_a_run_ending_on_a_busy_machine_leaves_no_execution_and_no_open_record(demo_run):
    run = demo_run
    assert run.returncode == 0, run.output[-5000:]
    drained = [line.removeprefix("[demo] drain: ") for line in run.output.splitlines()
               if line.startswith("[demo] drain: ")]  # fmt: skip
    assert drained, run.output[-3000:]
    cancelled = assert_everything_closed(run.db, run.gym_left, drained, run.output[-5000:])
    print(f"normal end, busy machine: cancelled rollouts={cancelled}; " + " | ".join(drained))


@pytest.mark.timeout(900)
def test_sigterm_mid_run_cancels_the_training_and_stops_every_worker(tmp_path):
    """SIGTERM to the launcher while episodes hold open executions: it stops train.py with a
    SIGTERM (exit 143), AReaL's workers, the vLLM server, the agent and the monitor stop, the
    records say cancelled, the drain closed the episodes, the launcher exits 130."""
    run_dir = tmp_path / "demo"
    db = run_dir / "monitor.db"
    log = tmp_path / "demo.out"
    # Every evaluate stalls, so the signal surely lands while episodes hold open executions.
    slow_evaluate = {"evaluate": Fault(latency_s=300)}
    t0 = time.monotonic()
    with GymServer() as gym, open(log, "wb") as out:
        gym.gym.config.faults.update(slow_evaluate)
        proc = subprocess.Popen(
            [sys.executable, "-m", "cua_rl.app.demo", "--run-dir", str(run_dir), "--quiet",
             "--gym-url", gym.url, *NO_LATENCY, *ASYNC, *NO_EVAL,
             # Enough steps that the signal lands mid-run, never after the end.
             "total_train_steps=20", "total_train_epochs=20"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            # Wait until episodes have run their agent (vLLM served them) and sit in evaluate.
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and proc.poll() is None:
                if gym.gym.counters["evaluations"] > 0:
                    break
                time.sleep(0.5)
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert httpx.get(f"{gym.base_url}/executions", timeout=10).json()["executions"]
            workers = descendants(proc.pid)
            commands = [_cmd(p) for p in workers]
            for role in ("examples.cua_agent.train", "cua_rl.inference.vllm_server",
                         "cua_rl.sim agent", "cua_rl.monitor"):  # fmt: skip
                assert any(role in c for c in commands), (role, commands)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=240)
            # Episodes cut short still terminate their gym executions: no box is left running.
            live = httpx.get(f"{gym.base_url}/executions", timeout=10).json()["executions"]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            gym.gym.config.faults.clear()
    note_cost("run end: SIGTERM", time.monotonic() - t0)
    text = log.read_text(errors="replace")
    assert rc == 130, text[-3000:]
    assert f"[demo] the trainer stopped: exit {128 + signal.SIGTERM}" in text, text[-3000:]
    status, message = db_rows(db, "SELECT status, status_message FROM training")[0]
    assert status == "cancelled" and "SIGTERM" in message, (status, message)
    drained = [line.removeprefix("[demo] drain: ") for line in text.splitlines()
               if line.startswith("[demo] drain: ")]  # fmt: skip
    cancelled = assert_everything_closed(db, live, drained, text[-3000:])
    assert cancelled > 0 and drained, text[-3000:]
    alive = [pid for pid in workers if _alive(pid)]
    assert not alive, subprocess.run(["ps", "-o", "pid,args", "-p", ",".join(map(str, alive))],
                                     capture_output=True, text=True).stdout  # fmt: skip
    assert not _leftovers(str(tmp_path)), _leftovers(str(tmp_path))


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.timeout(900)
def test_systematic_rejection_stops_the_training_failed_with_its_reason(
    tmp_path, tiny_vl_bpe_model_dir, model_servers, warm_env
):
    """An agent that returns no token data, called directly (no gateway): every episode is
    rejected missing_tokens. The run stops within the window, failed, naming reason and fix."""
    db = tmp_path / "monitor.db"
    window = 6
    server = model_servers("qwen2-vl-bpe")
    with GymServer() as gym, AgentServer() as agent:
        t0 = time.monotonic()
        proc = subprocess.run(
            train_command(
                tiny_vl_bpe_model_dir, gym.url, agent.url, f"monitor.db_path={db}", tmp_path,
                *NO_EVAL, server.borrow_override(),
                "endpoint.mode=direct",
                # local.yaml's agent already asks for no token data, like an unpatched agent.
                f"failfast.window={window}",
                # Above local.yaml's 4 episodes in flight: a count is allowed to trip at once.
                "failfast.persist_s=0",
                "total_train_steps=20", "total_train_epochs=20",
            ),
            cwd=ROOT, capture_output=True, text=True, timeout=800,
            env={**os.environ, **warm_env},
        )  # fmt: skip
        took = time.monotonic() - t0
        live = httpx.get(f"{gym.base_url}/executions", timeout=10).json()["executions"]
    note_cost("run end: fail-fast", took)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    assert "missing_tokens" in proc.stderr and "endpoint.mode=gateway" in proc.stderr
    status, err = db_rows(db, "SELECT status, error_message FROM training")[0]
    assert status == "failed", (status, err)
    assert "missing_tokens" in err and "endpoint.mode=gateway" in err, err
    rejected = db_rows(db, "SELECT COUNT(*) FROM rollout WHERE status = 'failed'")[0][0]
    # Stopped within the window: the rejections that tripped it, plus at most the episodes
    # already running when it did (4 groups of 2) and those ending during one poll and the stop.
    assert window <= rejected <= window + 2 * 4 * 2, rejected
    assert_everything_closed(db, live, _drain_lines(proc.stderr), proc.stderr[-3000:])
    print(f"stopped after {took:.0f}s and {rejected} rejected episodes")
    assert not _leftovers(str(tmp_path)), _leftovers(str(tmp_path))
