"""Fixtures for the monitor: temp-file stores, record factories, a real monitor process.

``MonitorProcess`` runs ``python -m cua_rl.monitor serve`` as a child in its own session on a
free loopback port; tests can SIGKILL and restart it on the same port and database.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from cua_rl.monitor.protocol import BATCH_KEY_HEADER
from cua_rl.monitor.server.store import IngestValidationError, MonitorStore

SEED = Path(__file__).parent / "data" / "training-monitor-schema.md"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MonitorProcess:
    def __init__(
        self,
        db: Path,
        token: str | None = "test-token",
        max_body_bytes: int = 1 << 20,
        extra_args: tuple[str, ...] = (),
    ):
        self.db = db
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.extra_args = list(extra_args)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log = db.with_suffix(".log")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def start(self, timeout: float = 30.0) -> None:
        cmd = [
            sys.executable,
            "-m",
            "cua_rl.monitor",
            "serve",
            "--db",
            str(self.db),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-body-bytes",
            str(self.max_body_bytes),
        ]
        if self.token:
            cmd += ["--token", self.token]
        cmd += self.extra_args
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("MONITOR_PROJECT_TOKEN", None)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"monitor exited early: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"monitor did not come up: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: no shutdown handlers, no flush; only committed transactions survive."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class FlakyMonitor:
    """Answers like the monitor from a real store; failures are injected per call."""

    def __init__(self, store: MonitorStore):
        self.store = store
        self.down = False  # connection refused
        self.fail_next: list[int] = []  # statuses to answer, one per call, before working again
        self.max_records: int | None = None  # answer 413 above this many records
        self.hang = False
        self.calls = 0
        self.batches: list[dict] = []  # every batch the store took, in order
        self.lose_answers = 0  # commit, then drop the connection before answering

    async def handler(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.hang:
            await asyncio.sleep(3600)
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if self.fail_next:
            status = self.fail_next.pop(0)
            return httpx.Response(
                status, json={"error": {"code": "x", "message": "injected", "details": None}}
            )
        batch = json.loads(request.content)
        n = sum(1 if k == "training" else len(v) for k, v in batch.items())
        if self.max_records is not None and n > self.max_records:
            return httpx.Response(
                413,
                json={"error": {"code": "body_too_large", "message": "too big", "details": None}},
            )
        try:
            answer = self.store.ingest(batch, request.headers.get(BATCH_KEY_HEADER))
            self.batches.append(batch)
            if self.lose_answers:
                self.lose_answers -= 1
                raise httpx.ReadError("connection reset after commit", request=request)
            return httpx.Response(200, json=answer)
        except IngestValidationError as exc:
            return httpx.Response(
                422,
                json={
                    "error": {
                        "code": "validation_error",
                        "message": str(exc),
                        "details": exc.details(),
                    }
                },
            )


@pytest.fixture
def store(tmp_path):
    s = MonitorStore(tmp_path / "monitor.db")
    yield s
    s.close()


@pytest.fixture
def monitor_process(tmp_path):
    proc = MonitorProcess(tmp_path / "served.db")
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def shared_monitor(tmp_path_factory):
    """One server for the HTTP contract tests; each test uses its own run names and uuids."""
    proc = MonitorProcess(tmp_path_factory.mktemp("monitor") / "shared.db")
    proc.start()
    yield proc
    proc.stop()


# Every table a batch can write to, with the side tables and the history.
COUNTED = (
    "training",
    "task",
    "validator",
    "step",
    "baseline",
    "eval",
    "rollout",
    "environment",
    "turn",
    "action",
    "obs",
    "validation",
    "status_history",
    "extra_field",
    "client_key",
)


def count_rows(conn, tables: tuple[str, ...] = COUNTED) -> dict[str, int]:
    return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables}


def uid(prefix: str = "") -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


def _training(**overrides):
    return {"run_name": uid("run-"), "log_path": "runs/x", "model_name": "tiny-vl", **overrides}


def _task(**overrides):
    return {
        "task_id": uid("task-"),
        "name": "open settings",
        "description": "Open the app",
        **overrides,
    }


def full_batch(run_name: str | None = None) -> dict:
    """A batch holding every key, in the existing clients' format (server-id references are
    replaced by client-id references, since the ids are not known before the first answer)."""
    run = run_name or uid("run-")
    task_id = uid("task-")
    rollout_uuid = uid("rollout-")
    return {
        "training": _training(
            run_name=run,
            status="running",
            lora_rank=8,
            learning_rate=1e-5,
            config_json={"lr": 1e-5},
            wandb_project="cua",
        ),
        "tasks": [_task(task_id=task_id, client_id=task_id, tags=["a", "b"], difficulty="easy")],
        "validators": [
            {
                "task_client_id": task_id,
                "validator_type": "state",
                "validation_query": "q",
                "config_json": {"k": 1},
            }
        ],
        "steps": [
            {
                "client_id": f"step-{run}-1-0",
                "training_client_id": run,
                "step": 1,
                "batch": 0,
                "status": "rollout_running",
                "rollout_progress": {"completed_groups": 0, "total_groups": 2},
            }
        ],
        "baselines": [
            {
                "client_id": f"baseline-{run}-t0",
                "training_client_id": run,
                "model_path": "m0",
                "status": "running",
            }
        ],
        "evals": [{"training_client_id": run, "step": 1, "model_path": "m1", "status": "running"}],
        "pauses": [
            {
                "client_id": f"pause-{run}-gym-w-1.000",
                "training_client_id": run,
                "service": "gym",
                "reason": "gym_error",
                "error_message": "gym create answered 500",
                "start_time": 1.0,
                "probes": 2,
            }
        ],
        "rollouts": [
            {
                "client_id": rollout_uuid,
                "rollout_id": rollout_uuid,
                "source_type": "step",
                "step_client_id": f"step-{run}-1-0",
                "task_client_id": task_id,
                "model_path": "m1",
                "group": 0,
                "env_index": 1,
                "status": "running",
                "gbox_run_id": "run-abc",
                "trajectory_data_json": {"turns": []},
            }
        ],
        "environments": [
            {
                "client_id": f"{rollout_uuid}:env",
                "rollout_client_id": rollout_uuid,
                "env_type": "android",
                "status": "running",
                "gbox_id": "box-1",
            }
        ],
        "turns": [
            {
                "client_id": f"{rollout_uuid}:turn:1",
                "rollout_client_id": rollout_uuid,
                "turn": 1,
                "model_response": "tap(1,2)",
                "metrics_json": {"t": 0.5},
                "screen_before": "s0.png",
            }
        ],
        "actions": [
            {
                "turn_client_id": f"{rollout_uuid}:turn:1",
                "action_type": "tap",
                "tool_name": "tap",
                "tool_args": {"x": 1, "y": 2},
                "tokens": [1, 2, 3],
                "logprobs": [-0.1, -0.2, -0.3],
                "num_tokens": 3,
            }
        ],
        "observations": [
            {
                "turn_client_id": f"{rollout_uuid}:turn:1",
                "obs_type": "screenshot",
                "screenshot_uri": "s1.png",
                "model_specific_input_json": {"a": 1},
            }
        ],
        "validations": [
            {
                "rollout_client_id": rollout_uuid,
                "success": True,
                "actual_result": "ok",
                "details_json": {"why": "matched"},
            }
        ],
    }


@pytest.fixture
def browser(tmp_path):
    from .browser import Browser

    b = Browser(tmp_path / "profile")
    yield b
    b.close()
