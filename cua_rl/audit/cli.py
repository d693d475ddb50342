"""``python -m cua_rl.audit --config FILE.yaml [key=value ...]``: audit the verifiers of a task source.

Reads the training's config (``cua_rl.app.config_load``: the same YAML and overrides, nothing
written), loads the tasks its gym section names (the train and eval split, or every task with
``audit.scope=all``), runs the scripted agents on fresh boxes with at most the rollout's number
of boxes open at once, prints a line per task as it ends and the flagged tasks at the end,
writes the JSON report and records the audit in the training's monitor. No model, no GPU.

Exit status: 0 nothing flagged; 1 a task flagged; 2 a configuration error; 3 a task could not be
audited (every run failed in the gym) or the gym could not be reached; 128 + the signal when
interrupted (SIGINT, SIGTERM), after every open box was terminated and the report of the tasks
audited so far written.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from cua_rl.errors import ConfigError, ServiceError, problem_lines

USAGE = """usage: python -m cua_rl.audit --config FILE.yaml [--local-gym "GYM ARGS"] [key=value ...]

Runs scripted agents (stop at once, wait, random actions, claim infeasible, replays of recorded
successes or known solutions) on every task of the config's task source, through its gym, and
flags verifiers that give free reward, reject their own success or are flaky. The audit's own
settings are the config's audit section (audit.repeats=5, audit.agents=[stop,wait], ...);
docs/audit.md says what each does. --local-gym starts the local gym with those arguments
(python -m cua_rl.sim gym's: "--backend browser", "--task-file my-tasks.yaml") and audits its
tasks instead of the config's gym. Exit 0: no task flagged; 1: a task flagged."""

EXIT_FLAGGED, EXIT_CONFIG, EXIT_UNCHECKED = 1, 2, 3


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else EXIT_CONFIG
    logging.basicConfig(
        level=os.environ.get("CUA_RL_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", default="")
    parser.add_argument("--local-gym", default=None)
    known, rest = parser.parse_known_args(argv)
    argv = ["--config", known.config, *rest] if known.config else rest
    if known.local_gym is None:
        return _audit(argv, known.config)
    try:
        gym = LocalGym(known.local_gym)
    except ConfigError as exc:
        print(f"config error: --local-gym: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    with gym:
        print(f"local gym: {gym.url}/api/v1/{gym.gym_id} (its log: {gym.log})", flush=True)
        return _audit([*argv, f"gym.base_url={gym.url}", f"gym.gym_id={gym.gym_id}"], known.config)


class LocalGym:
    """``python -m cua_rl.sim gym ARGS`` on a free loopback port, as a process of its own (the
    audit is product code: it runs the local stand-in by module name, it does not import it),
    stopped with its process group at the end; it terminates every box still open as it stops."""

    def __init__(self, args: str, timeout_s: float = 120.0):
        self.log = Path(tempfile.mkstemp(prefix="cua-rl-audit-gym-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "cua_rl.sim", "gym", "--port", "0", *shlex.split(args)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.log.read_text(errors="replace")
            ready = [line for line in text.splitlines() if line.startswith("ready ")]
            if ready:
                self.url, self.gym_id = ready[0].split()[1].split("/api/v1/")
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                lines = text.strip().splitlines() or ["no output"]
                raise ConfigError(f"the local gym did not start: {lines[-1]}")
            time.sleep(0.1)  # a poll of the gym's own ready line

    def __enter__(self) -> LocalGym:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc.returncode == 0:  # stopped cleanly: nothing in its log to keep
            self.log.unlink(missing_ok=True)


def _audit(argv: list[str], config_path: str) -> int:
    from cua_rl.app import config_load
    from cua_rl.app.config import CUAConfig

    try:
        config = config_load.load_config(argv, CUAConfig, write=False, needs_model=False)
    except ConfigError as exc:
        for line in problem_lines(exc):
            print(f"config error: {line}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        return asyncio.run(_interruptible(config, config_path))
    except ConfigError as exc:
        for line in problem_lines(exc):
            print(f"config error: {line}", file=sys.stderr)
        return EXIT_CONFIG
    except (ServiceError, httpx.HTTPError, OSError) as exc:
        print(f"service error: {exc}", file=sys.stderr)
        return EXIT_UNCHECKED


async def _interruptible(config: Any, config_path: str) -> int:
    """The audit in a task that SIGINT and SIGTERM cancel; the exit status."""
    loop = asyncio.get_running_loop()
    got: list[int] = []
    work = asyncio.ensure_future(run_audit(config, config_path, got))

    def stop(signum: int) -> None:
        name = signal.Signals(signum).name
        if got:  # the boxes' terminates are under way, each bounded
            print(f"{name}: still terminating the open boxes", flush=True)
            return
        print(f"\n{name}: stopping; terminating the open boxes", flush=True)
        got.append(signum)
        work.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop, signum)
    try:
        return await work
    except asyncio.CancelledError:
        return 128 + got[0] if got else 130
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def _selected(config: Any, tasks: list) -> list:
    if config.audit.scope == "all":
        return tasks
    from cua_rl.tasks import select_tasks

    split = select_tasks(tasks, config.gym.selection)
    seen: dict[str, Any] = {}
    for t in (*split.train, *split.eval):
        seen.setdefault(t.id, t)
    return sorted(seen.values(), key=lambda t: t.id)


def concurrency_of(config: Any) -> int:
    """``audit.concurrency``, else the rollout's bound, else one batch's episodes."""
    return (
        config.audit.concurrency
        or config.rollout.max_concurrent_rollouts
        or config.train_dataset.batch_size * config.gconfig.n_samples
    )


def report_path(config: Any, started: datetime) -> Path:
    if config.audit.out:
        return Path(config.audit.out)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    return Path(config.cluster.fileroot) / "audits" / f"{config.gym.gym_id}-{stamp}.json"


async def run_audit(config: Any, config_path: str, interrupted: list[int]) -> int:
    from cua_rl.app.check import fetch_tasks
    from cua_rl.app.endpoint import MonitorEndpoint
    from cua_rl.audit.record import AuditRecord
    from cua_rl.audit.report import Progress, counts, summary_line, write_json
    from cua_rl.audit.session import Audit
    from cua_rl.clients.genv import GenvClient

    started = datetime.now(UTC)
    audit_id = f"audit-{config.gym.gym_id}-{started:%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
    tasks = _selected(config, await fetch_tasks(config))
    n = concurrency_of(config)
    out = report_path(config, started)
    a = config.audit
    print(
        f"auditing {len(tasks)} tasks of gym {config.gym.gym_id!r} at {config.gym.base_url}: "
        f"agents {', '.join(a.agents)}, {a.repeats} runs of each sequence, at most {n} boxes "
        f"at once",
        flush=True,
    )
    with MonitorEndpoint(config) as endpoint:
        client = None
        if endpoint.url:
            from cua_rl.monitor.worker.client import MonitorClient

            client = MonitorClient(endpoint.client_config(out.parent))
            await client.start()
            print(f"monitor: {endpoint.url} (the audit's page: /audits)", flush=True)
        record = AuditRecord(client, audit_id)
        progress = Progress(len(tasks), width=max((len(t.id) for t in tasks), default=8))

        def on_task(result) -> None:
            progress.task(result)
            record.task(result)

        async def successes(task_id: str) -> list:
            return await client.successes(task_id, list(a.replay_trainings), -1, a.replays_per_task)

        async with GenvClient(
            config.gym.base_url, config.gym.gym_id, timeouts=config.gym.timeouts
        ) as genv:
            audit = Audit(
                a, genv, n, successes=successes if client is not None else None, on_task=on_task
            )
            record.started(
                gym_base_url=config.gym.base_url,
                gym_id=config.gym.gym_id,
                config_path=config_path,
                total=len(tasks),
                settings={**asdict(a), "concurrency": n},
            )
            t0, status, message = time.monotonic(), "completed", ""
            try:
                results = await audit.run(tasks)
            except asyncio.CancelledError:
                status, results = "cancelled", sorted(audit.results, key=lambda r: r.task.id)
                message = f"interrupted after {len(results)} of {len(tasks)} tasks"
            except Exception as exc:
                status, results = "failed", sorted(audit.results, key=lambda r: r.task.id)
                message = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                boxes = audit.executions()
                report = {
                    "audit": {
                        "id": audit_id,
                        "status": status,
                        "message": message,
                        "config": config_path,
                        "gym": {"base_url": config.gym.base_url, "gym_id": config.gym.gym_id},
                        "started_at": started.isoformat(),
                        "finished_at": datetime.now(UTC).isoformat(),
                        "settings": {**asdict(a), "concurrency": n},
                        "tasks": len(tasks),
                        "audited": len(audit.results),
                        "counts": counts(audit.results),
                        "executions": boxes,
                    },
                    "tasks": [r.to_json() for r in sorted(audit.results, key=lambda r: r.task.id)],
                }
                write_json(out, report)
                record.finished(
                    status, counts=counts(audit.results), executions=boxes, message=message
                )
                if client is not None:
                    await client.close()
        progress.table(results)
        print(summary_line(results, len(tasks), time.monotonic() - t0, boxes), flush=True)
        print(f"report: {out}", flush=True)
    if status == "cancelled":
        raise asyncio.CancelledError
    if any(r.verdict.flagged for r in results):
        return EXIT_FLAGGED
    return EXIT_UNCHECKED if any(r.verdict.verdict == "unchecked" for r in results) else 0
