"""Train a GUI agent with AReaL's PPOTrainer: ``python -m examples.cua_agent.train --config X.yaml``.

The script loads the config (``config_load``: a YAML plus ``key=value`` overrides, any field),
selects the tasks into train and eval datasets, opens the run's monitor records (an embedded
SQLite monitor when only ``monitor.db_path`` is given), runs a baseline evaluation, then
``PPOTrainer.train`` with ``CUAAgentWorkflow`` and the complete-group filter passed by dotted
path. The training record ends completed, or failed with the error (cancelled on Ctrl-C or
SIGTERM: a first SIGTERM stops as Ctrl-C does, AReaL's workers and servers included; a second one
kills at once). However the run ends, AReaL's clean-up destroys the rollout engine before it stops
the workers, and that drains the episodes in flight (``cua_rl.rollout.drain``).

``total_train_steps=0`` runs the baseline pass alone: ``actor.path`` evaluated, nothing trained.

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
from pathlib import Path
from typing import Any

from cua_rl.app import config_load
from cua_rl.app.check import fetch_tasks, run_check
from cua_rl.app.config import CUAConfig
from cua_rl.app.endpoint import MonitorEndpoint
from cua_rl.app.failfast import RejectionWatch
from cua_rl.app.harness import (
    connect_cpu_harness_to_ray,
    cuda_available,
    start_cpu_harness,
    use_cpu_harness,
)
from cua_rl.app.run_record import claim_run_name, record_fields
from cua_rl.app.signals import SystematicRejection, Terminated, stop_systematic, stopping
from cua_rl.app.signals import install as install_signals
from cua_rl.app.usage import exit_with_help_if_asked
from cua_rl.areal.hooks import TrainerHooks
from cua_rl.areal.support import check_areal
from cua_rl.audit.flagged import select_unflagged
from cua_rl.audit.live import step_share
from cua_rl.errors import ConfigError, ServiceError, problem_lines
from cua_rl.logs import get_logger, warnings_only
from cua_rl.monitor.worker.training import TrainingMonitor
from cua_rl.tasks import to_dataset

# Its module name spelt out: run as ``python -m``, ``__name__`` would be ``__main__``.
log = get_logger("cua_rl.app.train")


# ---------------------------------------------------------------------------- arguments


def split_argv(argv: list[str]) -> tuple[bool, list[str]]:
    """Our own flags out, AReaL's (``--config`` and overrides) through; ``--help`` answered
    (``usage.py``)."""
    exit_with_help_if_asked(argv)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--check", action="store_true")
    known, rest = parser.parse_known_args(argv)
    return known.check, rest


def load_config(argv: list[str], *, write: bool = True, launch: bool = False) -> CUAConfig:
    # AReaL's load_expr_config, with known fields settable without "+" and every mistake one
    # line (config_load.py); write=False for --check, which writes nothing; launch=True adds
    # what the values point at on this machine (model folder and family, workflow, gateway:
    # preflight.py), for a launch and --check alike.
    return config_load.load_config(argv, CUAConfig, write=write, launch=launch)


def config_errors(exc: ConfigError) -> int:
    """Each problem on its own ``config error:`` line; the exit status for them (2)."""
    for line in problem_lines(exc):
        print(f"config error: {line}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------- training


def batches_per_epoch(config: CUAConfig, n_train: int) -> int:
    return max(n_train // config.train_dataset.batch_size, 1)


def total_steps(config: CUAConfig, n_train: int) -> int:
    steps = config.total_train_epochs * batches_per_epoch(config, n_train)
    if config.total_train_steps is not None:
        steps = min(steps, config.total_train_steps)
    return steps


def steps_capped(config: CUAConfig, n_train: int) -> str | None:
    """The line saying that ``total_train_steps`` asked for more steps than the epochs hold (AReaL
    trains the smaller count), or None: a run that stops early must say why."""
    asked, steps = config.total_train_steps, total_steps(config, n_train)
    if asked is None or asked <= steps:
        return None
    return (
        f"note: total_train_steps={asked}, but total_train_epochs={config.total_train_epochs} x "
        f"{batches_per_epoch(config, n_train)} batches of {config.train_dataset.batch_size} tasks hold {steps}: training "
        f"{steps} steps (raise total_train_epochs to train {asked})"
    )


def configure_platform(config: CUAConfig) -> None:
    """With ``cpu: true``, make the config and this process fit AReaL's CPU path
    (docs/areal-cpu.md); on GPUs with ``inference.environment: own``, make the rollout workers
    start vLLM from its own environment (docs/gpu.md). Before the monitor records the config:
    the record is the config that runs. The config decides, not this machine's CUDA: a Ray or
    Slurm trainer usually has none (cua_rl/app/harness.py)."""
    if not config.cpu:
        if config.inference.own(config):
            from cua_rl.inference.config import use_own_environment

            python = config.inference.interpreter(cpu=False)
            if not Path(python).exists():
                raise ConfigError(
                    f"the inference environment's interpreter {python} does not exist: run "
                    "`make gpu-stack` on this node (docs/gpu.md), or set inference.python"
                )
            for line in use_own_environment(config, python):
                log.info("[inference] %s", line)
        return
    start_cpu_harness(config)


def connect_cluster(config: CUAConfig) -> None:
    """Under ``scheduler.type: ray``, connect to the cluster (docs/cluster.md)."""
    if config.scheduler.type != "ray":
        return
    from cua_rl.areal.ray_job import connect

    if config.cpu:
        connect_cpu_harness_to_ray(connect)
    elif config.inference.own(config):
        from cua_rl.areal.worker import RAY_SETUP_HOOK

        connect(RAY_SETUP_HOOK)
    else:
        connect()


def evaluates(config: CUAConfig) -> bool:
    """Whether the run evaluates at all: the eval-only pass, a baseline before training, or
    AReaL's evaluator at some frequency (with none, its check never fires)."""
    ev = config.evaluator
    every = (ev.freq_epochs, ev.freq_steps, ev.freq_secs)
    return (
        config.total_train_steps == 0 or ev.eval_before_train or any(f is not None for f in every)
    )


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
        monitor_token=endpoint.token or None,
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
    tasks = asyncio.run(fetch_tasks(config))
    # gym.selection's split, without the tasks an audit flagged (curriculum.skip_flagged).
    split, left_out = select_unflagged(config, tasks)
    if left_out:
        print(left_out, flush=True)
    train_ds, eval_ds = to_dataset(split.train), to_dataset(split.eval)
    n_steps = total_steps(config, len(train_ds))
    capped = steps_capped(config, len(train_ds))
    if capped:
        print(capped, flush=True)
    if config.total_train_steps == 0 and not len(eval_ds):
        raise ConfigError(
            "total_train_steps=0 evaluates the eval split, but gym.selection leaves it empty: "
            "select eval tasks (docs/cluster.md, Evaluating a checkpoint)"
        )
    log_dir = Path(StatsLogger.get_log_path(config.stats_logger))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"tasks: {len(train_ds)} train / {len(eval_ds)} eval; {n_steps} steps of "
        f"{config.train_dataset.batch_size} tasks x {config.gconfig.n_samples} samples",
        flush=True,
    )

    configure_platform(config)
    watch = RejectionWatch(log_dir / "outcomes", config.failfast, stop_systematic).start()
    with MonitorEndpoint(config) as endpoint, stopping(watch):
        # A second run of the same names gets its own record unless it resumes (run_record.py).
        claim_run_name(
            config, endpoint.url if config.monitor.enabled else "", endpoint.token or None
        )
        monitor = TrainingMonitor(
            endpoint.client_config(log_dir),
            config.run_name,
            heartbeat_s=config.monitor.heartbeat_s,
            episodes_per_step=config.train_dataset.batch_size * config.gconfig.n_samples,
        )
        monitor.start()
        # The config as it runs: every default, derived value and CPU change applied.
        monitor.training_started(
            config=config, total_steps=n_steps, log_path=str(log_dir), **record_fields(config)
        )
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
        run = _Run(config, train_ds, eval_ds, n_steps, log_dir, endpoint, monitor, hooks)
        try:
            run.train()
        except BaseException as exc:
            monitor.step_failed(hooks.current_step, exc)
            monitor.training_failed(exc)
            monitor.close()
            raise
        monitor.training_finished()
        monitor.close()
        _report(config, hooks, endpoint, monitor, log_dir)
    return 0


class _Run:
    """The trainer's part of a run, once its monitor records are open."""

    def __init__(self, config, train_ds, eval_ds, n_steps, log_dir, endpoint, monitor, hooks):
        self.config, self.train_ds, self.eval_ds = config, train_ds, eval_ds
        self.n_steps, self.log_dir, self.endpoint = n_steps, log_dir, endpoint
        self.monitor, self.hooks = monitor, hooks

    def settings(self) -> dict[str, Any]:
        return {
            phase: self.config.workflow_settings(
                monitor_base_url=self.endpoint.url,
                monitor_token=self.endpoint.token,
                phase=phase,
                total_steps=self.n_steps,
                outcome_dir=str(self.log_dir / "outcomes"),
            )
            for phase in ("train", "eval", "baseline")
        }

    def train(self) -> None:
        config, eval_ds = self.config, self.eval_ds
        sampler = None
        try:
            sampler = curriculum_sampler(config, self.train_ds, self.endpoint, self.log_dir)
            if sampler is not None:
                self.hooks.step_stats = sampler.pop_step_stats
            connect_cluster(config)
            settings = self.settings()
            # No valid dataset, so no eval rollout worker (cua_rl/areal/actor.py), where the gym
            # gives no eval task or nothing in the run would evaluate them.
            valid = eval_ds if len(eval_ds) and evaluates(config) else None
            with make_trainer(config, self.train_ds, valid, sampler) as trainer:
                self.monitor.config_ran(trainer.config)
                # total_train_steps=0: the baseline pass alone evaluates actor.path. The hooks
                # record training steps (attaching opens the first): none runs then.
                eval_only = config.total_train_steps == 0
                if not eval_only:
                    self.hooks.attach(trainer)
                if config.evaluator.eval_before_train or eval_only:
                    run_baseline(trainer, config, self.monitor, settings["baseline"], len(eval_ds))
                if eval_only:
                    print(f"evaluated {config.model_path()} on {len(eval_ds)} tasks", flush=True)
                    return
                trainer.train(
                    workflow=config.workflow,
                    workflow_kwargs={"settings": settings["train"]},
                    eval_workflow=config.workflow if valid is not None else None,
                    eval_workflow_kwargs={"settings": settings["eval"]},
                    dynamic_filter_fn=config.group_filter(),
                )
        finally:
            if sampler is not None:
                sampler.close()


def _report(config, hooks, endpoint, monitor, log_dir: Path) -> None:
    previous = None
    for step, stats in hooks.committed:
        print(f"step {step}: {summarise(stats, since=previous)}", flush=True)
        previous = step
    where = endpoint.url if endpoint.server is None else config.monitor.db_path
    print(f"monitor: {where or 'disabled'}; logs: {log_dir}", flush=True)
    if monitor.counters:
        print(f"monitor client: {monitor.counters}", flush=True)


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
    free = step_share(stats)
    if free:  # rewarded episodes in which no action changed the state (docs/audit.md)
        parts.append(f"free_reward={free:.3f}")
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
    if check:
        # --check writes nothing, the workflow module's bytecode cache included.
        sys.dont_write_bytecode = True
    try:
        config = load_config(rest, write=not check, launch=True)
    except ConfigError as exc:
        return config_errors(exc)
    if check:
        # Its report is its table: a client's retry lines (the gym's while it is down) would
        # land among its lines, and the line of the service they are about says the outcome.
        with warnings_only():
            return run_check(config)
    try:
        # Before anything starts: a local GPU run without CUDA would fail in the workers.
        use_cpu_harness(config, cuda_available())
    except ConfigError as exc:
        return config_errors(exc)
    try:
        # Every AReaL internal the run will override or wrap, looked up before it starts.
        check_areal()
    except ConfigError as exc:
        print(f"AReaL error: {exc}", file=sys.stderr)
        return 2
    install_signals()
    try:
        return run_training(config)
    except SystematicRejection as exc:
        print(f"training failed: {exc}", file=sys.stderr)
        return 3
    except ConfigError as exc:
        return config_errors(exc)
    except ServiceError as exc:
        # A gym, agent or monitor that cannot be reached is the operator's to fix, not a bug.
        print(f"service error: {exc} (--check tests every service)", file=sys.stderr)
        return 1
    except Terminated as exc:
        # Already recorded as cancelled and cleaned up; exit as a process killed by it would.
        print(f"stopped by {exc}", file=sys.stderr)
        return 128 + signal.SIGTERM


def cli() -> None:
    """``python -m examples.cua_agent.train``'s work, in its process or in a fork of a zygote
    that imported this module (cua_rl/cpu/warm_start.py ``TRAINER_ENTRY``)."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
