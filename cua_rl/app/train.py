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

from cua_rl.app.config import CUAConfig
from cua_rl.app.failfast import RejectionWatch, advice_for
from cua_rl.areal.hooks import TrainerHooks
from cua_rl.errors import AgentError, ConfigError, CuaRlError, GymError
from cua_rl.genv import GenvClient
from cua_rl.logs import get_logger
from cua_rl.monitor.worker.training import TrainingMonitor
from cua_rl.rollout.groups import GROUP_SIZE_ENV, ZERO_VARIANCE_TOL_ENV
from cua_rl.tasks import Task, build_datasets, load_tasks, select_tasks

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

        if config.endpoint.mode == "gateway":
            results.append(gateway_check(config))

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
                from cua_rl.monitor.server.store import MonitorStore

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


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def gateway_check(config: CUAConfig) -> CheckResult:
    """The gateway starts with the rollout workers; what can be checked now is whether the agent
    will be able to reach the address it is told."""
    from urllib.parse import urlsplit

    g = config.gateway
    told = g.public_host or (
        "the worker's IP" if g.bind_host in ("0.0.0.0", "::", "") else g.bind_host
    )
    detail = (
        f"each rollout worker listens on {g.bind_host}:{g.bind_port or 'a free port'}, "
        f"the agent is told {told}"
    )
    agent_host = (urlsplit(config.agent.base_url).hostname or "").lower()
    local_agent = agent_host in _LOOPBACK
    reachable = local_agent or (g.bind_host not in _LOOPBACK and told not in _LOOPBACK)
    if not reachable:
        detail += (
            f"; the agent at {agent_host} runs elsewhere and cannot reach a loopback gateway: "
            "set gateway.bind_host=0.0.0.0 (and gateway.public_host to an address it can reach)"
        )
    return CheckResult("gateway", reachable, detail)


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
            from cua_rl.monitor.server.app import create_app
            from cua_rl.monitor.server.store import MonitorStore
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
        from cua_rl.monitor.worker.client import MonitorClientConfig

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
    """On a machine without a GPU, apply what AReaL needs to train on CPU (docs/areal-cpu.md);
    under ``scheduler.type: ray`` connect to the cluster first (docs/cluster.md)."""
    import torch

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        from cua_rl.cpu.training import enable_cpu_training

        enable_cpu_training(config)
        if config.scheduler.type == "slurm":
            from cua_rl.cpu.training import native_slurm

            native_slurm()
    if config.scheduler.type == "ray":
        from cua_rl.areal.ray_job import connect

        if on_cpu:
            from cua_rl.cpu.training import RAY_SETUP_HOOK, pin_host_ip

            connect(RAY_SETUP_HOOK, loopback=True)
            import ray

            pin_host_ip(ray.util.get_node_ip_address())
        else:
            connect()


def run_baseline(trainer: Any, config: CUAConfig, monitor: TrainingMonitor, settings, n_eval: int):
    """Evaluate the initial policy on the eval split before any update (the baseline record)."""
    if trainer.eval_rollout is None or trainer.valid_dataloader is None or not n_eval:
        return
    monitor.baseline_started(model_path=config.model_path(), total_tasks=n_eval)
    try:
        evaluate = getattr(trainer._evaluate_fn, "__wrapped__", trainer._evaluate_fn)
        evaluate(eval_workflow=config.workflow, eval_workflow_kwargs={"settings": settings})
        stats = trainer.eval_rollout.export_stats()
    except Exception as exc:
        monitor.baseline_finished({}, error=f"{type(exc).__name__}: {exc}")
        raise
    monitor.baseline_finished(stats)
    log.info(
        "baseline: %s",
        {k: round(v, 4) for k, v in stats.items() if k.startswith("eval-rollout/cua/")},
    )


def curriculum_sampler(config: CUAConfig, train_ds, endpoint: MonitorEndpoint, log_dir: Path):
    """The UCB curriculum's sampler, or None for AReaL's uniform one (docs/curriculum.md)."""
    if config.curriculum.kind != "ucb":
        return None
    from cua_rl.areal.curriculum_trainer import make_sampler

    return make_sampler(
        config.curriculum,
        list(train_ds["task_id"]),
        monitor_url=endpoint.url,
        run_name=config.run_name,
        monitor_token=config.monitor.token or os.environ.get("MONITOR_PROJECT_TOKEN") or None,
        batch_size=config.train_dataset.batch_size,
        group_size=config.gconfig.n_samples,
        seed=config.seed,
        drop_last=config.train_dataset.drop_last,
        log_dir=log_dir,
    )


def make_trainer(config: CUAConfig, train_ds, valid_ds, sampler):
    """AReaL's PPOTrainer, or its curriculum form; either with selective logits unless
    ``logits.selective=false`` (docs/logits.md)."""
    from areal import PPOTrainer

    from cua_rl.areal.logits import trainer_class

    if sampler is None:
        base, extra = PPOTrainer, {}
    else:
        from cua_rl.areal.curriculum_trainer import CurriculumPPOTrainer

        base, extra = CurriculumPPOTrainer, {"sampler": sampler}
    cls = trainer_class(config.logits, base)
    return cls(config, train_dataset=train_ds, valid_dataset=valid_ds, **extra)


def run_training(config: CUAConfig) -> int:
    from areal.utils.stats_logger import StatsLogger

    from cua_rl.areal.ports import unseed_port_choice

    # Two trainings of one seed on a machine would otherwise draw the same ports (ports.py).
    unseed_port_choice()
    # The group filters run in the rollout workers, which inherit these.
    os.environ[GROUP_SIZE_ENV] = str(config.gconfig.n_samples)
    os.environ[ZERO_VARIANCE_TOL_ENV] = repr(config.curriculum.zero_variance_tol)
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

    watch = RejectionWatch(log_dir / "outcomes", config.failfast, _stop_systematic).start()
    with MonitorEndpoint(config) as endpoint, _stopping(watch):
        monitor = TrainingMonitor(endpoint.client_config(log_dir), config.run_name)
        monitor.start()
        monitor.training_started(config=config, total_steps=n_steps, log_path=str(log_dir))
        monitor.tasks(
            [{**r, "split": "train"} for r in train_ds] + [{**r, "split": "eval"} for r in eval_ds]
        )
        sampler = None
        hooks = TrainerHooks(
            monitor,
            total_steps=n_steps,
            model_path=config.model_path(),
            eval_tasks=len(eval_ds),
            learning_rate=config.actor.optimizer.lr if config.actor.optimizer else None,
        )
        try:
            sampler = curriculum_sampler(config, train_ds, endpoint, log_dir)
            if sampler is not None:
                hooks.step_stats = sampler.pop_step_stats
            prepare_platform(config)
            settings = {
                phase: config.workflow_settings(
                    monitor_base_url=endpoint.url,
                    phase=phase,
                    total_steps=n_steps,
                    outcome_dir=str(log_dir / "outcomes"),
                )
                for phase in ("train", "eval", "baseline")
            }
            valid = eval_ds if len(eval_ds) else None
            with make_trainer(config, train_ds, valid, sampler) as trainer:
                hooks.attach(trainer)
                if config.evaluator.eval_before_train:
                    run_baseline(trainer, config, monitor, settings["baseline"], len(eval_ds))
                trainer.train(
                    workflow=config.workflow,
                    workflow_kwargs={"settings": settings["train"]},
                    eval_workflow=config.workflow if valid is not None else None,
                    eval_workflow_kwargs={"settings": settings["eval"]},
                    dynamic_filter_fn=config.group_filter(),
                )
        except BaseException as exc:
            monitor.step_failed(hooks.current_step, exc)
            monitor.training_failed(exc)
            monitor.close()
            raise
        finally:
            if sampler is not None:
                sampler.close()
        monitor.training_finished()
        monitor.close()
        previous = None
        for step, stats in hooks.committed:
            print(f"step {step}: {summarise(stats, since=previous)}", flush=True)
            previous = step
        where = endpoint.url if endpoint.server is None else config.monitor.db_path
        print(f"monitor: {where or 'disabled'}; logs: {log_dir}", flush=True)
        if monitor.counters:
            print(f"monitor client: {monitor.counters}", flush=True)
    return 0


class SystematicRejection(KeyboardInterrupt):
    """Every recent episode was rejected for one reason: stopping is the only useful thing left.
    Raised where Ctrl-C would be, so AReaL stops its workers and servers the same way."""

    is_failure = True

    def __init__(self, reason: str, window: int):
        super().__init__(reason)
        self.reason, self.window = reason, window

    def __str__(self) -> str:
        return (
            f"the last {self.window} episodes were all rejected {self.reason!r}: "
            f"{advice_for(self.reason)} (failfast.window={self.window}; 0 turns the check off)"
        )


_tripped: list[tuple[str, int]] = []


def _stop_systematic(reason: str, window: int) -> None:
    # Called on the watch's thread: the main thread is inside AReaL, so interrupt it the way
    # SIGTERM does; the handler raises there.
    _tripped.append((reason, window))
    os.kill(os.getpid(), signal.SIGUSR1)


def _raise_systematic(signum: int, frame: Any) -> None:
    reason, window = _tripped[-1] if _tripped else ("unknown", 0)
    raise SystematicRejection(reason, window)


class _stopping:
    def __init__(self, watch: RejectionWatch):
        self.watch = watch

    def __enter__(self):
        return self.watch

    def __exit__(self, *exc):
        self.watch.stop()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be: AReaL stops its workers and inference servers on
    an interrupt but not on SIGTERM, and a batch scheduler ends jobs with SIGTERM."""


def _terminate_like_ctrl_c(signum: int, frame: Any) -> None:
    # A second SIGTERM during the clean-up takes the default action: the operator insists.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated(signal.Signals(signum).name)


def summarise(stats: dict[str, float], since: int | None = None) -> str:
    """One step's line. AReaL exports, at each commit, the stats of the episodes that finished
    since the previous commit, whichever step trains them: asynchronous runs finish some steps'
    episodes early, so the window is named rather than implied."""
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
    groups = {
        "zero_variance": "rollout/cua/group/zero_variance",
        "dropped_zero_variance": "rollout/cua/group/rejected/zero_variance",
        "never_tried": "curriculum/never_tried",
        "sampled_success": "curriculum/sampled_success",
    }
    parts += [f"{name}={stats[k]:.3f}" for name, k in groups.items() if k in stats]
    rows = stats.get("ppo_actor/n_seqs")
    head = f"trained {int(rows)} rows; " if rows is not None else ""
    window = "since the start" if since is None else f"since step {since}"
    if not parts:
        return head + f"no episode finished {window} (its batch was complete before)"
    return head + f"episodes finished {window}: " + " ".join(parts)


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
    signal.signal(signal.SIGUSR1, _raise_systematic)
    # A process started in the background by a non-interactive shell inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return run_training(config)
    except SystematicRejection as exc:
        print(f"training failed: {exc}", file=sys.stderr)
        return 3
    except Terminated as exc:
        # Already recorded as cancelled and cleaned up; exit as a process killed by it would.
        print(f"stopped by {exc}", file=sys.stderr)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
