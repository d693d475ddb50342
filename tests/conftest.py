"""Fixtures shared by every test area: tiny local models, real vLLM CPU servers, one demo run.

Models are built once into the repository's cache (``.cache/models``, or ``$CUA_RL_CACHE``) and
reused across sessions; servers are started once per session on free loopback ports and stopped
by process group at the end. ``demo_run`` runs ``make demo``'s launcher once per session; the
demo's own test and the dashboard's browser tests share it.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cua_rl.testing.cache import ensure_model
from cua_rl.testing.sockets import Endpoint, tree_sockets
from cua_rl.testing.vllm_server import VLLMServer


@pytest.fixture(scope="session")
def tiny_vl_model_dir():
    """Tiny random Qwen2-VL with the byte-only tokenizer (prefix property holds on ASCII)."""
    return ensure_model("qwen2-vl-byte")


@pytest.fixture(scope="session")
def tiny_vl_bpe_model_dir():
    """Tiny random Qwen2-VL with a byte-level BPE tokenizer (prefix breaks under sampling)."""
    return ensure_model("qwen2-vl-bpe")


@pytest.fixture(scope="session")
def tiny_text_model_dir():
    return ensure_model("qwen2-text")


@pytest.fixture(scope="session")
def vllm_server(tiny_vl_model_dir):
    with VLLMServer(tiny_vl_model_dir, model="tiny-vl") as server:
        yield server


@pytest.fixture(scope="session")
def vllm_bpe_server(tiny_vl_bpe_model_dir):
    with VLLMServer(tiny_vl_bpe_model_dir, model="tiny-vl-bpe") as server:
        yield server


@dataclass
class DemoRun:
    run_dir: Path
    output: str
    returncode: int
    # Every inet socket its process tree had while a training episode was running (union of
    # the samples), and how many samples saw one running.
    sockets: set[Endpoint] = field(default_factory=set)
    samples_mid_step: int = 0

    @property
    def db(self) -> Path:
        return self.run_dir / "monitor.db"


# The command issue 12 tried as a new user would (it lost 6 of 24 episodes before the gateway).
DEMO_OVERRIDES = (
    "rollout.max_head_offpolicyness=2",
    "total_train_epochs=6",
    "total_train_steps=6",
    "rollout.max_concurrent_rollouts=8",
)
DEMO_STEPS = 6
# Every task trains, none evaluates: no eval-rollout worker, no baseline pass, no eval after each
# step. For the trainings whose subject is the training path (each family, each context policy);
# the demo's own run (tests/app/test_train_local.py) keeps the evaluations and checks them.
NO_EVAL = ("gym.selection.train_ratio=1.0", "gym.selection.eval_number_range=null")


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, tiny_vl_model_dir):
    """``python -m cua_rl.app.demo`` once, in the regime production trains in: six real
    PPO steps, asynchronous (two steps of staleness, eight episodes in flight), through the
    gateway, with the BPE tiny model; the monitor on SQLite."""
    run_dir = tmp_path_factory.mktemp("demo") / "demo"
    return run_demo(run_dir, *DEMO_OVERRIDES, timeout=1700)


def open_files_under(folder: Path) -> list[str]:
    """What this process's descriptors point to under ``folder`` (an unlinked file's target
    still names the folder it was made in, with " (deleted)")."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target.startswith(f"{folder}/"):
            targets.append(target)
    return targets


def db_rows(db: Path, sql: str, *args) -> list[tuple]:
    """The rows of one query on a SQLite file (the monitor's database after a run)."""
    con = sqlite3.connect(db)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def _step_rollouts_running(db: Path) -> bool:
    if not db.exists():
        return False
    try:
        rows = db_rows(
            db, "SELECT COUNT(*) FROM rollout WHERE source_type = 'step' AND status = 'running'"
        )
    except sqlite3.Error:  # tables not created yet, or a write holds the lock
        return False
    return rows[0][0] > 0


def train_command(
    model_dir: Path, gym_url: str, agent_url: str, monitor: str, run_dir: Path, *overrides: str
) -> list[str]:
    """``python -m examples.cua_agent.train`` on configs/local.yaml against local services;
    ``monitor`` is one override (``monitor.base_url=...`` or ``monitor.db_path=...``) and AReaL's
    files go under ``run_dir``."""
    return [
        sys.executable, "-m", "examples.cua_agent.train",
        "--config", "configs/local.yaml",
        f"actor.path={model_dir}",
        f"gym.base_url={gym_url}",
        f"agent.base_url={agent_url}",
        monitor,
        f"cluster.fileroot={run_dir / 'areal'}",
        f"cluster.name_resolve.nfs_record_root={run_dir / 'name_resolve'}",
        *overrides,
    ]  # fmt: skip


# The context-policy trainings: 3 steps (2 of staleness, so updates land while later episodes run).
CONTEXT_STEPS = 3


@pytest.fixture(scope="session")
def context_runs(tmp_path_factory):
    """``get(mode, policy, steps)``: a real asynchronous training of the local agent with that
    context policy (``agent.mode`` service or builtin), every episode stored, run once per
    session and shared by the tests that read it (every call trains: tests/app/
    test_context_train.py; the export proven by its consumers: tests/warehouse/
    test_export_consumers.py, which ride in one pytest process, scripts/test_shards.py)."""
    runs: dict[tuple[str, str, int], DemoRun] = {}

    def get(mode: str, policy: str, steps: int) -> DemoRun:
        key = (mode, policy, steps)
        if key not in runs:
            run_dir = tmp_path_factory.mktemp(f"context-{mode}-{policy}") / "run"
            runs[key] = run_demo(
                run_dir,
                f"--agent-mode={mode}",
                # One step of staleness: at most two steps' episodes can start before the first
                # weight update, so a third step's were sampled by a later version, whatever the
                # machine's speed (with two, all three steps' could finish at version 0).
                "rollout.max_head_offpolicyness=1",
                f"total_train_epochs={steps}",
                f"total_train_steps={steps}",
                "rollout.max_concurrent_rollouts=8",
                f"agent.context={policy}",
                "monitor.store_episodes=all",
                *NO_EVAL,
                timeout=1500,
            )
        return runs[key]

    return get


def run_demo(run_dir: Path, *args: str, timeout: float) -> DemoRun:
    """``python -m cua_rl.app.demo --run-dir RUN_DIR ARGS`` in its own process group, killed
    whole if it outlives ``timeout``. While a training episode runs (the monitor's database
    says so), the sockets of every process of the run are read (``DemoRun.sockets``)."""
    log = run_dir.parent / f"{run_dir.name}.out"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cua_rl.app.demo", "--run-dir", str(run_dir), *args],
            cwd=Path(__file__).resolve().parents[1],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    sockets: set[Endpoint] = set()
    mid_step = 0
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if _step_rollouts_running(run_dir / "monitor.db"):
                sockets.update(tree_sockets(proc.pid))
                mid_step += 1
            time.sleep(0.5)  # a sampling period; nothing is decided by it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    output = log.read_text(errors="replace")
    return DemoRun(run_dir, output, proc.returncode, sockets, mid_step)
