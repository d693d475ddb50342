"""Each scheduler the trainer builds waits ``worker_startup_s`` for its workers, not AReaL's 30 s
(a forked eval-rollout worker on a busy node took longer, and the run ended at start-up)."""

from __future__ import annotations

from pathlib import Path

import pytest
from areal import PPOTrainer

from cua_rl.app.config import CUAConfig
from cua_rl.app.config_load import load_config
from cua_rl.areal.actor import with_actor

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path, *overrides: str) -> CUAConfig:
    return load_config(
        [
            "--config",
            str(ROOT / "configs" / "local.yaml"),
            f"cluster.fileroot={tmp_path}",
            "actor.path=/models/unused",  # required at launch; nothing here loads it
            *overrides,
        ],
        CUAConfig,
    )


def _scheduler(tmp_path, *overrides: str):
    # The trainer's own method, on an instance that has only what it reads (its config).
    trainer = object.__new__(with_actor(PPOTrainer))
    trainer.config = _config(tmp_path, *overrides)
    return trainer._init_scheduler()


@pytest.mark.parametrize("kind", ["local", "ray", "slurm"])
def test_the_scheduler_waits_the_configured_time(tmp_path, kind):
    scheduler = _scheduler(tmp_path, f"scheduler.type={kind}", "worker_startup_s=123")
    assert type(scheduler).__name__.lower().startswith(kind)
    assert scheduler.startup_timeout == 123


def test_the_default_is_longer_than_areals(tmp_path):
    assert _config(tmp_path).worker_startup_s == 300


class _FakeClock:
    """``time.time`` for the scheduler's module: each reading is 10 s after the one before."""

    def __init__(self):
        self.now = 1_000_000.0

    def time(self) -> float:
        self.now += 10
        return self.now


@pytest.mark.parametrize("kind", ["local", "slurm"])
def test_a_forked_worker_is_waited_for_as_long_as_a_started_one(tmp_path, monkeypatch, kind):
    # AReaL waits 60 s for a worker it forks from another (the eval rollout worker), whatever
    # its start-up timeout. A worker that answers its health check after 90 s (by the scheduler's
    # clock, 10 s a reading) must still be taken with worker_startup_s=123.
    import asyncio
    import importlib
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import aiohttp

    polls = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            polls.append(self.path)
            self.send_response(200 if len(polls) >= 9 else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    scheduler = _scheduler(tmp_path, f"scheduler.type={kind}", "worker_startup_s=123")
    module = importlib.import_module(type(scheduler).__module__)

    async def no_wait(_seconds):
        return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(module, "time", _FakeClock())
    monkeypatch.setattr(module.asyncio, "sleep", no_wait)

    async def wait() -> bool:
        async with aiohttp.ClientSession() as session:
            return await scheduler._wait_for_fork_ready(session, "127.0.0.1", server.server_port)

    try:
        ready = asyncio.run(wait())
    finally:
        server.shutdown()
        server.server_close()
    assert ready and len(polls) == 9, polls
