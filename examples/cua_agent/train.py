"""Train a GUI agent with AReaL's PPOTrainer: ``python -m examples.cua_agent.train --config X.yaml``.

The script loads the config (AReaL's ``load_expr_config``: a YAML plus ``key=value`` overrides),
selects the tasks into train and eval datasets, opens the run's monitor records (an embedded
SQLite monitor when only ``monitor.db_path`` is given), runs a baseline evaluation, then
``PPOTrainer.train`` with ``CUAAgentWorkflow`` and the complete-group filter passed by dotted
path. The training record ends completed, or failed with the error (cancelled on Ctrl-C or
SIGTERM: a first SIGTERM stops as Ctrl-C does, AReaL's workers and servers included; a second one
kills at once).

``--check`` validates the config and reaches the gym, the agent, the model endpoint and the
monitor, printing one line per service, and exits 1 if any is unreachable, without training.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from cua_rl.errors import AgentError, ConfigError, CuaRlError, GymError
from cua_rl.genv import GenvClient
from cua_rl.logs import get_logger
from cua_rl.tasks import Task, build_datasets, load_tasks, select_tasks
from examples.cua_agent.config import CUAConfig
from examples.cua_agent.lifecycle import TrainerHooks, TrainingMonitor
from examples.cua_agent.workflow import GROUP_SIZE_ENV

WORKFLOW = "examples.cua_agent.workflow.CUAAgentWorkflow"
GROUP_FILTER = "examples.cua_agent.workflow.complete_groups"

log = get_logger("cua_rl.train")


# ---------------------------------------------------------------------------- arguments


def split_argv(argv: list[str]) -> tuple[bool, list[str]]:
    """Our own flags out, AReaL's (``--config`` and overrides) through."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.cua_agent.train",
        description=__doc__.split("\n\n")[0],
        add_help=False,
    )
    parser.add_argument("--check", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    known, rest = parser.parse_known_args(argv)
    if known.help:
        print(__doc__)
        print(
            "usage: python -m examples.cua_agent.train --config FILE.yaml [--check] [key=value ...]"
        )
        raise SystemExit(0)
    return known.check, rest


def load_config(argv: list[str]) -> CUAConfig:
    from areal.api.cli_args import load_expr_config

    config, _ = load_expr_config(argv, CUAConfig)
    return config


# ---------------------------------------------------------------------------- tasks


async def fetch_tasks(config: CUAConfig) -> list[Task]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as http:
        client = None
        if config.gym.source.kind == "gym":
            client = GenvClient(
                config.gym.base_url, config.gym.gym_id, client=http, timeouts=config.gym.timeouts
            )
        return await load_tasks(config.gym.source, client)


# ---------------------------------------------------------------------------- --check


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name:<8} {self.detail}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, httpx.ConnectError):
        return f"unreachable ({exc})"
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


async def check_services(config: CUAConfig, *, timeout: float = 10.0) -> list[CheckResult]:
    results: list[CheckResult] = []
    async with httpx.AsyncClient(timeout=timeout) as http:
        # Gym: list and select tasks, so a bad selection shows here too.
        try:
            tasks = await fetch_tasks(config)
            split = select_tasks(tasks, config.gym.selection)
            results.append(
                CheckResult(
                    "gym",
                    True,
                    f"{config.gym.base_url or config.gym.source.kind}: {len(tasks)} tasks, "
                    f"{len(split.train)} train / {len(split.eval)} eval after selection",
                )
            )
        except (GymError, CuaRlError, httpx.HTTPError, OSError) as exc:
            results.append(CheckResult("gym", False, f"{config.gym.base_url}: {_reason(exc)}"))

        # Agent: no health endpoint is known; any HTTP answer to a run lookup proves it serves.
        agent_url = config.agent.base_url.rstrip("/")
        try:
            resp = await http.get(f"{agent_url}/runs/cua-rl-check")
            ok = resp.status_code in (200, 404)
            detail = f"{agent_url}: answers (HTTP {resp.status_code})"
            results.append(CheckResult("agent", ok, detail if ok else f"{detail}, unexpected"))
        except (httpx.HTTPError, AgentError) as exc:
            results.append(CheckResult("agent", False, f"{agent_url or '(unset)'}: {_reason(exc)}"))

        # Model endpoint: an external one must serve the model; the engine's own are started later.
        if config.endpoint.base_url:
            url = config.endpoint.base_url.rstrip("/")
            try:
                resp = await http.get(f"{url}/models")
                resp.raise_for_status()
                names = [m.get("id") for m in resp.json().get("data", [])]
                want = config.endpoint.model_name or config.model_path()
                ok = not want or want in names
                detail = f"{url}: serves {names}" + ("" if ok else f", not {want!r}")
                results.append(CheckResult("model", ok, detail))
            except (httpx.HTTPError, ValueError) as exc:
                results.append(CheckResult("model", False, f"{url}: {_reason(exc)}"))
        else:
            path = config.model_path()
            ok = bool(path) and (not path.startswith(("/", ".")) or Path(path).exists())
            results.append(
                CheckResult(
                    "model",
                    ok,
                    f"engine servers started by the trainer from {path!r}"
                    + ("" if ok else " (path does not exist)"),
                )
            )

        # Monitor: a URL must answer with the token; an embedded one must open its database.
        base = config.monitor.base_url or os.environ.get("MONITOR_BASE_URL", "")
        if not config.monitor.enabled:
            results.append(CheckResult("monitor", True, "disabled"))
        elif base:
            token = config.monitor.token or os.environ.get("MONITOR_PROJECT_TOKEN", "")
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            try:
                resp = await http.get(f"{base.rstrip('/')}/api/trainings?limit=1", headers=headers)
                ok = resp.status_code == 200
                why = "token refused" if resp.status_code == 401 else f"HTTP {resp.status_code}"
                results.append(CheckResult("monitor", ok, f"{base}: {'ok' if ok else why}"))
            except httpx.HTTPError as exc:
                results.append(CheckResult("monitor", False, f"{base}: {_reason(exc)}"))
        else:
            try:
                from cua_rl.monitor.store import MonitorStore

                Path(config.monitor.db_path).parent.mkdir(parents=True, exist_ok=True)
                MonitorStore(config.monitor.db_path).close()
                results.append(
                    CheckResult("monitor", True, f"embedded, database {config.monitor.db_path}")
                )
            except Exception as exc:
                results.append(
                    CheckResult("monitor", False, f"{config.monitor.db_path}: {_reason(exc)}")
                )
    return results


def run_check(config: CUAConfig) -> int:
    print(f"ok   config   {config.experiment_name}/{config.trial_name} is valid")
    results = asyncio.run(check_services(config))
    for r in results:
        print(r.line())
    failed = [r.name for r in results if not r.ok]
    if failed:
        print(f"unreachable or misconfigured: {', '.join(failed)}")
        return 1
    return 0


# ---------------------------------------------------------------------------- the monitor


class MonitorEndpoint:
    """The monitor URL for this run: the configured one, or an embedded server on a SQLite file."""

    def __init__(self, config: CUAConfig):
        self.config = config
        self.server = None
        self.store = None
        self.url = ""

    def __enter__(self) -> MonitorEndpoint:
        m = self.config.monitor
        if not m.enabled:
            return self
        self.url = m.base_url or os.environ.get("MONITOR_BASE_URL", "")
        if not self.url and m.db_path:
            from cua_rl.monitor.app import create_app
            from cua_rl.monitor.store import MonitorStore
            from cua_rl.serving import ThreadedServer

            Path(m.db_path).parent.mkdir(parents=True, exist_ok=True)
            self.store = MonitorStore(m.db_path)
            self.server = ThreadedServer(
                create_app(self.store, token=m.token or None), name="monitor"
            ).start()
            self.url = self.server.url
            log.info("embedded monitor on %s, database %s", self.url, m.db_path)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()
        if self.store is not None:
            self.store.close()

    def client_config(self, spool_dir: Path):
        if not self.url:
            return None
        from cua_rl.monitor.client import MonitorClientConfig

        m = self.config.monitor
        return MonitorClientConfig(
            base_url=self.url,
            token=m.token or os.environ.get("MONITOR_PROJECT_TOKEN") or None,
            spool_path=m.spool_path or str(spool_dir / "monitor-spool.jsonl"),
        )


# ---------------------------------------------------------------------------- training


def total_steps(config: CUAConfig, n_train: int) -> int:
    per_epoch = max(n_train // config.train_dataset.batch_size, 1)
    steps = config.total_train_epochs * per_epoch
    if config.total_train_steps is not None:
        steps = min(steps, config.total_train_steps)
    return steps


def prepare_platform(config: CUAConfig) -> None:
    """On a machine without a GPU, apply what AReaL needs to train on CPU (docs/areal-cpu.md)."""
    import torch

    if torch.cuda.is_available():
        return
    from cua_rl.areal_ext.cpu import enable_cpu_training

    enable_cpu_training(config)


def run_baseline(trainer: Any, config: CUAConfig, monitor: TrainingMonitor, settings, n_eval: int):
    """Evaluate the initial policy on the eval split before any update (the baseline record)."""
    if trainer.eval_rollout is None or trainer.valid_dataloader is None or not n_eval:
        return
    monitor.baseline_started(model_path=config.model_path(), total_tasks=n_eval)
    try:
        evaluate = getattr(trainer._evaluate_fn, "__wrapped__", trainer._evaluate_fn)
        evaluate(eval_workflow=WORKFLOW, eval_workflow_kwargs={"settings": settings})
        stats = trainer.eval_rollout.export_stats()
    except Exception as exc:
        monitor.baseline_finished({}, error=f"{type(exc).__name__}: {exc}")
        raise
    monitor.baseline_finished(stats)
    log.info(
        "baseline: %s",
        {k: round(v, 4) for k, v in stats.items() if k.startswith("eval-rollout/cua/")},
    )


def run_training(config: CUAConfig) -> int:
    from areal.utils.stats_logger import StatsLogger

    from cua_rl.areal_ext.logits import trainer_class

    os.environ[GROUP_SIZE_ENV] = str(config.gconfig.n_samples)
    tasks = asyncio.run(fetch_tasks(config))
    train_ds, eval_ds = build_datasets(tasks, config.gym.selection)
    n_steps = total_steps(config, len(train_ds))
    log_dir = Path(StatsLogger.get_log_path(config.stats_logger))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"tasks: {len(train_ds)} train / {len(eval_ds)} eval; {n_steps} steps of "
        f"{config.train_dataset.batch_size} tasks x {config.gconfig.n_samples} samples",
        flush=True,
    )

    with MonitorEndpoint(config) as endpoint:
        monitor = TrainingMonitor(endpoint.client_config(log_dir), config.run_name)
        monitor.start()
        monitor.training_started(config=config, total_steps=n_steps, log_path=str(log_dir))
        monitor.tasks(
            [{**r, "split": "train"} for r in train_ds] + [{**r, "split": "eval"} for r in eval_ds]
        )
        hooks = TrainerHooks(
            monitor,
            total_steps=n_steps,
            model_path=config.model_path(),
            eval_tasks=len(eval_ds),
            learning_rate=config.actor.optimizer.lr if config.actor.optimizer else None,
        )
        try:
            prepare_platform(config)
            settings = {
                phase: config.workflow_settings(
                    monitor_base_url=endpoint.url, phase=phase, total_steps=n_steps
                )
                for phase in ("train", "eval", "baseline")
            }
            valid = eval_ds if len(eval_ds) else None
            trainer_cls = trainer_class(config.logits)  # PPOTrainer, or its selective-logits form
            with trainer_cls(config, train_dataset=train_ds, valid_dataset=valid) as trainer:
                hooks.attach(trainer)
                if config.evaluator.eval_before_train:
                    run_baseline(trainer, config, monitor, settings["baseline"], len(eval_ds))
                trainer.train(
                    workflow=WORKFLOW,
                    workflow_kwargs={"settings": settings["train"]},
                    eval_workflow=WORKFLOW if valid is not None else None,
                    eval_workflow_kwargs={"settings": settings["eval"]},
                    dynamic_filter_fn=GROUP_FILTER,
                )
        except BaseException as exc:
            monitor.step_failed(hooks.current_step, exc)
            monitor.training_failed(exc)
            monitor.close()
            raise
        monitor.training_finished()
        monitor.close()
        for step, stats in hooks.committed:
            print(f"step {step}: {summarise(stats)}", flush=True)
        where = endpoint.url if endpoint.server is None else config.monitor.db_path
        print(f"monitor: {where or 'disabled'}; logs: {log_dir}", flush=True)
        if monitor.counters:
            print(f"monitor client: {monitor.counters}", flush=True)
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be: AReaL stops its workers and inference servers on
    an interrupt but not on SIGTERM, and a batch scheduler ends jobs with SIGTERM."""


def _terminate_like_ctrl_c(signum: int, frame: Any) -> None:
    # A second SIGTERM during the clean-up takes the default action: the operator insists.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated(signal.Signals(signum).name)


def summarise(stats: dict[str, float]) -> str:
    keys = {
        "reward": "rollout/cua/reward",
        "success": "rollout/cua/success",
        "trained_tokens": "rollout/cua/trained_tokens",
        "turns": "rollout/cua/turns",
        "accepted": "rollout/cua/accepted",
    }
    parts = [f"{name}={stats[k]:.3f}" for name, k in keys.items() if k in stats]
    rejected = {
        k.removeprefix("rollout/cua/rejected/"): v
        for k, v in stats.items()
        if k.startswith("rollout/cua/rejected/")
    }
    if rejected:
        parts.append(f"rejected={rejected}")
    return " ".join(parts) or "(no rollout stats)"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("CUA_RL_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per HTTP request (monitor batches, gym calls) would drown the trainer's progress.
    # A filter on the handler, not a logger level: AReaL replaces the logging manager whenever it
    # creates a logger, so getLogger("httpx") here may not be the logger httpx writes to.
    for handler in logging.root.handlers:
        handler.addFilter(
            lambda r: not (r.name.startswith("httpx") and r.levelno < logging.WARNING)
        )
    check, rest = split_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        config = load_config(rest)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if check:
        return run_check(config)
    signal.signal(signal.SIGTERM, _terminate_like_ctrl_c)
    # A process started in the background by a non-interactive shell inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return run_training(config)
    except Terminated as exc:
        # Already recorded as cancelled and cleaned up; exit as a process killed by it would.
        print(f"stopped by {exc}", file=sys.stderr)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
