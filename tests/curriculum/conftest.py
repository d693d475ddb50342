"""A real monitor (SQLite in tmp_path, HTTP on loopback) and a way to record rollouts in it in
the wire format the rollout workers use."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import httpx
import pytest

from cua_rl.monitor.protocol import eval_client_id, step_client_id
from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.serving import ThreadedServer


@dataclass
class Monitor:
    url: str
    store: MonitorStore

    def record(self, run: str, rollouts: list[dict]) -> None:
        """Each rollout: ``task``, ``step`` and optional ``status`` (completed), ``reward``,
        ``success``, ``source`` (step or eval)."""
        tasks = sorted({r["task"] for r in rollouts})
        steps = sorted({r["step"] for r in rollouts if r.get("source", "step") == "step"})
        evals = sorted({r["step"] for r in rollouts if r.get("source") == "eval"})
        batch = {
            "training": {"run_name": run, "log_path": "logs", "model_name": "m"},
            "tasks": [{"client_id": t, "task_id": t, "name": t, "description": ""} for t in tasks],
            "steps": [
                {"client_id": step_client_id(run, s), "training_client_id": run, "step": s}
                for s in steps
            ],
            "evals": [
                {
                    "client_id": eval_client_id(run, s),
                    "training_client_id": run,
                    "step": s,
                    "model_path": "m",
                }
                for s in evals
            ],
            "rollouts": [],
        }
        for r in rollouts:
            source = r.get("source", "step")
            ref = (
                step_client_id(run, r["step"])
                if source == "step"
                else eval_client_id(run, r["step"])
            )
            record = {
                "rollout_id": str(uuid.uuid4()),
                "source_type": source,
                f"{source}_client_id": ref,
                "task_client_id": r["task"],
                "model_path": "m",
                "status": r.get("status", "completed"),
            }
            if "reward" in r:
                record["reward"] = r["reward"]
            if "success" in r:
                record["task_success"] = int(r["success"])
            batch["rollouts"].append(record)
        resp = httpx.post(f"{self.url}/api/ingest/batch", json=batch, timeout=10)
        assert resp.status_code == 200, resp.text


@pytest.fixture
def monitor(tmp_path):
    store = MonitorStore(str(tmp_path / "monitor.db"))
    with ThreadedServer(create_app(store)) as server:
        yield Monitor(server.url, store)
    store.close()
