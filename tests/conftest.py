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
from dataclasses import dataclass
from pathlib import Path

import pytest

from cua_rl.testing.cache import ensure_model
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


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, tiny_vl_model_dir):
    """``python -m cua_rl.app.demo`` once, in the regime production trains in: six real
    PPO steps, asynchronous (two steps of staleness, eight episodes in flight), through the
    gateway, with the BPE tiny model; the monitor on SQLite."""
    run_dir = tmp_path_factory.mktemp("demo") / "demo"
    return run_demo(run_dir, *DEMO_OVERRIDES, timeout=1700)


def db_rows(db: Path, sql: str, *args) -> list[tuple]:
    """The rows of one query on a SQLite file (the monitor's database after a run)."""
    con = sqlite3.connect(db)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def run_demo(run_dir: Path, *args: str, timeout: float) -> DemoRun:
    """``python -m cua_rl.app.demo --run-dir RUN_DIR ARGS`` in its own process group, killed
    whole if it outlives ``timeout``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cua_rl.app.demo", "--run-dir", str(run_dir), *args],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return DemoRun(run_dir, out.decode(errors="replace"), proc.returncode)
