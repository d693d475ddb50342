"""``--help`` of the launcher: what it takes, and the config's sections with where each is documented.

Answered before anything heavy is imported: the config's dataclasses import AReaL, and AReaL
imports torch, which took the help 12 s. So the sections are written out here rather than read
from ``CUAConfig``; ``tests/app/test_usage.py`` checks them against it (every section listed,
each with the class and the file that declare its fields), so a new section fails that test
until it has its line.
"""

from __future__ import annotations

USAGE = (
    "usage: .venv/bin/python -m examples.cua_agent.train --config FILE.yaml [--check] "
    "[key=value ...]"
)

ABOUT = """\
Train a GUI agent with AReaL's PPOTrainer: tasks from the gym, episodes run by the agent through
the rollout gateway, PPO on the exact tokens sampled, every step recorded by the Training Monitor.

options:
  --config FILE.yaml  the config: configs/local.yaml runs on this machine (what make demo runs,
                      with the model and the services' URLs filled in), configs/cua.yaml on a
                      GPU cluster (docs/cluster.md)
  --check             load the whole config and report every problem in it, then reach every
                      service it names, one line each; trains nothing and writes nothing
  key=value           set any field of the config, listed in the YAML or not, e.g.
                      gym.gym_id=android-world actor.optimizer.lr=1e-6 (no Hydra '+' needed)
  -h, --help          this text

A mistake in the config is one 'config error:' line per problem, naming the key, whether the
file or the command line set it, and the fix (exit 2)."""

# (section, what it sets, the class declaring its fields, that class's file). Each field's help
# is its ``doc(default, help)`` here, ``field(metadata={"help": ...})`` in AReaL's file.
AREAL = "areal/api/cli_args.py"
SECTIONS: tuple[tuple[str, str, str, str], ...] = (
    ("actor", "the policy: path, optimizer, PPO loss, vision tower",
     "CuaActorConfig", "cua_rl/areal/vision.py"),
    ("rollout", "inference backend, concurrency, staleness, timeouts",
     "InferenceEngineConfig", AREAL),
    ("gconfig", "sampling in training: n_samples (the group), temperature",
     "GenerationHyperparameters", AREAL),
    ("eval_gconfig", "sampling in the baseline and evals (null: gconfig's)",
     "GenerationHyperparameters", AREAL),
    ("gym", "the gym server: URL, gym id, task selection, timeouts",
     "GymSection", "cua_rl/rollout/settings.py"),
    ("agent", "the agent: service URL or builtin loop, limits",
     "AgentSection", "cua_rl/rollout/settings.py"),
    ("endpoint", "what the agent calls: the gateway, or vLLM directly",
     "EndpointSection", "cua_rl/rollout/settings.py"),
    ("gateway", "the rollout gateway: addresses, pauses, limits",
     "GatewayConfig", "cua_rl/gateway/config.py"),
    ("trajectory", "the agent's events to training rows",
     "TrajectoryConfig", "cua_rl/trajectory/config.py"),
    ("reward", "the gym's verdict to a reward, shaping terms", "RewardConfig", "cua_rl/reward.py"),
    ("group_norm", "GRPO's normalisation of each group's rewards",
     "GroupNormConfig", "cua_rl/rollout/groups.py"),
    ("monitor", "the Training Monitor: URL and token, or an SQLite file",
     "MonitorSection", "cua_rl/app/config.py"),
    ("curriculum", "which tasks a batch draws (uniform, UCB), flagged tasks left out",
     "CurriculumConfig", "cua_rl/curriculum/selector.py"),
    ("audit", "the verifier audit (python -m cua_rl.audit): agents, repeats",
     "AuditConfig", "cua_rl/audit/config.py"),
    ("replay", "recorded successes put into groups that all failed",
     "ReplayConfig", "cua_rl/warehouse/replay.py"),
    ("step_credit", "each step's own advantage, from the screens' states (off by default)",
     "StepCreditConfig", "cua_rl/credit/config.py"),
    ("logits", "where the trainer computes full-vocabulary logits",
     "LogitsConfig", "cua_rl/areal/logits.py"),
    ("failfast", "stop a run whose episodes are all rejected",
     "FailFastConfig", "cua_rl/app/failfast.py"),
    ("pause", "episodes wait while a service fails", "PauseConfig", "cua_rl/rollout/settings.py"),
    ("drain", "closing the episodes in flight at the end",
     "DrainConfig", "cua_rl/rollout/settings.py"),
    ("inference", "where the vLLM server runs from: its own environment, or AReaL's",
     "InferenceSection", "cua_rl/inference/config.py"),
    ("vllm", "the vLLM servers AReaL launches", "CUAvLLMConfig", "cua_rl/app/config.py"),
    ("sglang", "the SGLang servers AReaL launches", "SGLangConfig", AREAL),
    ("cluster", "nodes, GPUs per node, file root, name_resolve", "ClusterSpecConfig", AREAL),
    ("scheduler", "AReaL's scheduler: local, ray or slurm", "SchedulerConfig", AREAL),
    ("train_dataset", "tasks per step (batch_size)", "TrainDatasetConfig", AREAL),
    ("valid_dataset", "tasks per eval batch", "ValidDatasetConfig", AREAL),
    ("saver", "checkpoints: how often", "SaverConfig", AREAL),
    ("evaluator", "evals: how often, the baseline first", "EvaluatorConfig", AREAL),
    ("recover", "resuming a killed run", "RecoverConfig", AREAL),
    ("stats_logger", "AReaL's stats: log folder, W&B", "StatsLoggerConfig", AREAL),
    ("ref", "the reference model, for actor.kl_ctl > 0", "PPOActorConfig", AREAL),
    ("critic", "a critic (GRPO trains none)", "PPOCriticConfig", AREAL),
    ("teacher", "on-policy distillation's teacher", "TeacherConfig", AREAL),
    ("perf_tracer", "AReaL's performance tracer", "PerfTracerConfig", AREAL),
    ("memory_profiler", "AReaL's memory snapshots", "MemoryProfilerConfig", AREAL),
)  # fmt: skip

TOP_LEVEL = (
    "(top level)",
    "experiment_name, trial_name, seed, cpu, workflow, ...",
    "CUAConfig",
    "cua_rl/app/config.py",
)


def help_text() -> str:
    rows = []
    for name, what, cls, path in (*SECTIONS, TOP_LEVEL):
        where = cls if path == AREAL else f"{cls}, {path}"
        rows.append(f"  {name:<15} {what:<57} {where}")
    return "\n".join(
        [
            USAGE,
            "",
            ABOUT,
            "",
            "config sections: section.field=value sets a field, whose help is where the class",
            "named declares it (AReaL's classes: areal/api/cli_args.py in its package);",
            "configs/cua.yaml says why each value it sets is set; docs/ has a page per area.",
            *rows,
        ]
    )


def wants_help(argv: list[str]) -> bool:
    return any(arg in ("-h", "--help") for arg in argv)


def exit_with_help_if_asked(argv: list[str]) -> None:
    """Print the help and exit 0 when ``argv`` asks for it; otherwise return."""
    if wants_help(argv):
        print(help_text())
        raise SystemExit(0)


def argv_problem(argv: list[str]) -> str | None:
    """What is wrong with the arguments themselves (no ``--config``, no such file, an option that
    is not one), said before the config's imports: a mistyped file name took 18 s to report
    (AReaL and torch imported first), now well under a second."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    parser.add_argument("--check", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if not args.config:
        return "--config FILE.yaml is required (e.g. --config configs/cua.yaml)"
    if not Path(args.config).is_file():
        return f"--config {args.config}: no such file"
    flags = [o for o in rest if o.startswith("-")]
    if flags:
        return f"unknown option {flags[0]}; overrides are key=value (no dashes)"
    return None


def exit_if_arguments_wrong(argv: list[str]) -> None:
    """``--help`` answered, or a mistake in the arguments themselves reported (one ``config
    error:`` line, exit 2), before anything heavy is imported; otherwise return."""
    import sys

    exit_with_help_if_asked(argv)
    problem = argv_problem(argv)
    if problem:
        print(f"config error: {problem}", file=sys.stderr)
        raise SystemExit(2)
