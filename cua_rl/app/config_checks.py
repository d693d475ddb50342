"""Range and consistency checks of the training config, one table row per field.

Each ``Rule`` names a dotted key, what its value must be, and the fix; a new field gets its check
by adding a row. The rules read the config through attribute access only, so they run on the
merged ``DictConfig`` before AReaL builds its dataclasses (pre-empting AReaL's own, less precise
errors: ``gconfig.n_samples=-1`` otherwise fails as a group-normalisation error) and again on
the built ``CUAConfig`` (for callers of AReaL's ``load_expr_config``). ``FieldError`` carries the
key, so the loader can say whether the file or the command line set it. Every row runs, failed
or not (``field_problems``): one run names every missing key and every value out of range.

The knobs users set (each numeric value the shipped configs set, among them the optimizer's,
the loss's clipping and KL) have rows here even where their section's ``__post_init__`` checks
them too: those checks raise one at a time, while building the dataclasses, without the key's
source. ``launch_problems`` adds what the launcher needs beyond a valid config: a model
(``actor.path``), and what only the machine can say: whether the folders and files the config
names could be created (``writable.py``), looked at without writing anything.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from cua_rl.agent.loop import IMAGE_MODES
from cua_rl.app.writable import why_unwritable
from cua_rl.errors import ConfigError, ConfigProblems
from cua_rl.rollout.settings import AGENT_MODES

ACTION_SPACES = ("mobile", "pc")
BOX_TYPES = ("", "android", "linux", "browser")
_UNSET = object()


class FieldError(ConfigError):
    """A value of one key is out of range; ``key`` names it for the loader's report."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Rule:
    key: str
    ok: Callable[[Any], bool]
    must: str
    fix: str
    # Values the rule refuses: the table's test feeds each through the loader.
    bad: tuple = ()
    # Whether the row applies to this config (a field only one mode reads); None: always.
    when: Callable[[Any], bool] | None = None
    # A missing value (None) fails the row instead of passing it.
    required: bool = False

    def problem(self, config: Any) -> FieldError | None:
        value = lookup(config, self.key)
        if value is _UNSET or (value is None and not self.required):
            return None
        if self.when is not None and not self.when(config):
            return None
        try:
            good = value is not None and self.ok(value)
        except TypeError:
            good = False
        if good:
            return None
        shown = "null" if value is None else repr(value)
        return FieldError(self.key, f"{self.key}={shown} must be {self.must}; {self.fix}")


def positive(key: str, fix: str) -> Rule:
    return Rule(key, lambda v: v > 0, "> 0", fix, bad=(0, -1))


def non_negative(key: str, off: str, fix: str) -> Rule:
    return Rule(key, lambda v: v >= 0, f">= 0 (0 {off})", fix, bad=(-1,))


def one_of(key: str, choices: tuple[str, ...], fix: str) -> Rule:
    return Rule(key, lambda v: v in choices, f"one of {', '.join(choices)}", fix, bad=("other",))


def within(key: str, lo: float, hi: float, fix: str, *, open_lo: bool = False) -> Rule:
    """``lo <= value <= hi`` (``lo < value`` with ``open_lo``)."""
    left = "(" if open_lo else "["
    return Rule(
        key,
        lambda v: (lo < v if open_lo else lo <= v) and v <= hi,
        f"within {left}{lo:g}, {hi:g}]",
        fix,
        bad=(lo - 0.5, hi + 0.5, *((lo,) if open_lo else ())),
    )


def non_empty(key: str, fix: str, when: Callable[[Any], bool] | None = None) -> Rule:
    return Rule(
        key,
        lambda v: bool(str(v).strip()),
        "set (it is required)",
        fix,
        bad=("",),
        when=when,
        required=True,
    )


def _agent_service(config: Any) -> bool:
    """Whether episodes run on an agent service (``agent.mode: service``, the default)."""
    return lookup(config, "agent.mode") in (_UNSET, None, "service")


def _gym_server(config: Any) -> bool:
    """Whether the tasks come from a gym server (``gym.source.kind: gym``, the default)."""
    return lookup(config, "gym.source.kind") in (_UNSET, None, "gym")


def _ratio_metric(config: Any) -> bool:
    return lookup(config, "actor.rejection_sampling.metric") in (_UNSET, None, "ratio")


# What a user sets to train (configs/cua.yaml): the optimizer, the loss, sampling, the engine.
TRAINING_RULES: tuple[Rule, ...] = (
    positive("actor.optimizer.lr", "the learning rate, e.g. actor.optimizer.lr=1e-6"),
    non_negative("actor.optimizer.weight_decay", "adds none", "e.g. 0.01"),
    within("actor.optimizer.beta1", 0, 1, "Adam's first moment decay, e.g. 0.9"),
    within("actor.optimizer.beta2", 0, 1, "Adam's second moment decay, e.g. 0.999"),
    positive("actor.optimizer.eps", "Adam's denominator term, e.g. actor.optimizer.eps=1e-8"),
    within(
        "actor.optimizer.warmup_steps_proportion",
        0,
        1,
        "the share of the steps spent warming the learning rate up, e.g. 0.0",
    ),
    within("actor.optimizer.min_lr_ratio", 0, 1, "the decayed learning rate's floor, e.g. 0.0"),
    positive(
        "actor.optimizer.gradient_clipping",
        "the largest gradient norm, e.g. actor.optimizer.gradient_clipping=1.0 (0 would zero "
        "every update)",
    ),
    positive("actor.eps_clip", "PPO's clipping of the ratio, e.g. actor.eps_clip=0.2"),
    positive("actor.eps_clip_higher", "the ratio's upper clip, e.g. 0.28, or null for eps_clip"),
    Rule(
        "actor.c_clip",
        lambda v: v > 1,
        "> 1",
        "dual clipping's bound, e.g. actor.c_clip=3, or null to turn it off",
        bad=(1, 0.5),
    ),
    non_negative("actor.kl_ctl", "adds no KL penalty", "e.g. actor.kl_ctl=0.0"),
    positive(
        "actor.temperature",
        "the temperature the trainer scores tokens at: gconfig.temperature's, e.g. 1.0",
    ),
    within("actor.discount", 0, 1, "e.g. actor.discount=1.0"),
    within("actor.gae_lambda", 0, 1, "e.g. actor.gae_lambda=1.0"),
    Rule(
        "actor.rejection_sampling.upper",
        lambda v: v > 1,
        "> 1 for the ratio metric (at 1 every token whose policy moved is filtered)",
        "e.g. actor.rejection_sampling.upper=5.0",
        bad=(1, 0.5),
        when=_ratio_metric,
    ),
    positive("actor.mb_spec.n_mbs", "micro-batches per minibatch, e.g. actor.mb_spec.n_mbs=1"),
    non_negative("gconfig.min_new_tokens", "sets no floor", "e.g. gconfig.min_new_tokens=0"),
    within("gconfig.top_p", 0, 1, "e.g. gconfig.top_p=1.0", open_lo=True),
    positive("eval_gconfig.max_new_tokens", "e.g. eval_gconfig.max_new_tokens=256"),
    non_negative("eval_gconfig.temperature", "is greedy", "e.g. eval_gconfig.temperature=0.0"),
    non_negative("eval_gconfig.min_new_tokens", "sets no floor", "e.g. 0"),
    within("eval_gconfig.top_p", 0, 1, "e.g. eval_gconfig.top_p=1.0", open_lo=True),
    within(
        "vllm.gpu_memory_utilization",
        0,
        1,
        "the share of each GPU's memory vLLM takes, e.g. 0.85",
        open_lo=True,
    ),
    positive("vllm.max_model_len", "the context in tokens, e.g. vllm.max_model_len=262144"),
    positive("rollout.setup_timeout", "seconds, e.g. rollout.setup_timeout=300"),
    positive("rollout.queue_size", "e.g. rollout.queue_size=64, or null for AReaL's default"),
    positive("cluster.n_nodes", "e.g. cluster.n_nodes=1"),
    positive("cluster.n_gpus_per_node", "e.g. cluster.n_gpus_per_node=8"),
    Rule("seed", lambda v: v >= 0, ">= 0 (numpy takes no negative seed)", "e.g. seed=1", bad=(-1,)),
    non_negative("train_dataset.num_workers", "loads in the trainer", "e.g. 0"),
    positive("saver.freq_epochs", "e.g. saver.freq_epochs=1, or null for no checkpoints"),
    positive("saver.freq_steps", "e.g. saver.freq_steps=10, or null"),
    positive("evaluator.freq_epochs", "e.g. evaluator.freq_epochs=1, or null for no evals"),
    positive("evaluator.freq_steps", "e.g. evaluator.freq_steps=10, or null"),
    positive("recover.freq_epochs", "e.g. recover.freq_epochs=1, or null"),
    positive("recover.freq_steps", "e.g. recover.freq_steps=10, or null"),
)

# The sections of this project whose own ``__post_init__`` also checks these (one at a time).
SECTION_RULES: tuple[Rule, ...] = (
    within("gym.selection.train_ratio", 0, 1, "the share of tasks that train, e.g. 0.9"),
    non_negative("agent.history_n", "takes the agent's default, 3", "e.g. agent.history_n=3"),
    non_negative("curriculum.exploration", "never explores", "e.g. 0.2"),
    within("curriculum.floor", 0, 1, "each task's least chance, e.g. 0.05"),
    within("curriculum.decay", 0, 1, "1 keeps every outcome, e.g. 0.9", open_lo=True),
    non_negative("failfast.persist_s", "stops at once", "seconds, e.g. failfast.persist_s=600"),
    positive("gateway.model_outage_s", "seconds, e.g. gateway.model_outage_s=600"),
    Rule(
        "gateway.pause_wait_factor",
        lambda v: v >= 1,
        ">= 1",
        "times the run's longest pause, e.g. gateway.pause_wait_factor=4",
        bad=(0.5, -1),
    ),
    positive("pause.probe_initial_s", "seconds, e.g. pause.probe_initial_s=1"),
    positive("pause.probe_max_s", "seconds, e.g. pause.probe_max_s=10"),
    positive("replay.per_group", "episodes put into a group, e.g. replay.per_group=1"),
    non_negative("replay.max_age_versions", "takes this version's only", "e.g. 4"),
    positive("replay.pool_per_task", "successes kept per task, e.g. 8"),
)


RULES: tuple[Rule, ...] = (
    positive("train_dataset.batch_size", "tasks per step, e.g. train_dataset.batch_size=8"),
    positive("valid_dataset.batch_size", "e.g. valid_dataset.batch_size=8"),
    positive("total_train_epochs", "e.g. total_train_epochs=10"),
    non_negative(
        "total_train_steps",
        "evaluates actor.path on the eval split without training",
        "e.g. total_train_steps=100, or null for the epochs' count",
    ),
    Rule(
        "rollout.max_concurrent_rollouts",
        lambda v: v > 0,
        "> 0",
        "each rollout holds a gym box and an agent run, so bound it to what your gym can host: "
        "e.g. rollout.max_concurrent_rollouts=32",
        bad=(0, -1),
        required=True,
    ),
    positive("rollout.consumer_batch_size", "set it to train_dataset.batch_size"),
    non_negative("rollout.max_head_offpolicyness", "is on-policy", "e.g. 1"),
    positive("rollout.request_timeout", "seconds, e.g. rollout.request_timeout=3600"),
    positive("gconfig.n_samples", "episodes per task (a GRPO group), e.g. gconfig.n_samples=4"),
    positive("gconfig.max_new_tokens", "e.g. gconfig.max_new_tokens=256"),
    non_negative("gconfig.temperature", "is greedy", "e.g. gconfig.temperature=1.0"),
    positive("eval_gconfig.n_samples", "e.g. eval_gconfig.n_samples=1"),
    positive("agent.max_steps", "steps of an agent run, e.g. agent.max_steps=15"),
    positive("agent.max_run_time_s", "seconds of an agent run, e.g. agent.max_run_time_s=900"),
    positive("agent.max_step_time_s", "seconds of one step, e.g. agent.max_step_time_s=120"),
    one_of("agent.action_space", ACTION_SPACES, "mobile for Android, pc for Linux desktops"),
    one_of("gym.box_type", BOX_TYPES, "android, linux or browser; empty: from agent.action_space"),
    one_of(
        "agent.mode",
        AGENT_MODES,
        "service runs each episode's agent on the service at agent.base_url, builtin runs the "
        "agent loop in the rollout worker (no agent service)",
    ),
    non_empty(
        "agent.base_url",
        "the gbox-mini-agent URL, e.g. agent.base_url=http://agent:3000, or agent.mode=builtin "
        "to run the agent loop in the rollout worker",
        when=_agent_service,
    ),
    non_empty(
        "gym.gym_id",
        "the id of the gym on your gym server, e.g. gym.gym_id=android-world; there is no "
        "default that is safe to assume",
        when=_gym_server,
    ),
    non_empty(
        "gym.base_url",
        "the gym server's URL without /api/v1, e.g. gym.base_url=http://gym:8800",
        when=_gym_server,
    ),
    one_of(
        "agent.builtin.image_mode",
        IMAGE_MODES,
        "data sends screenshots as data URLs, url as the gym's screenshot URLs",
    ),
    non_negative(
        "agent.builtin.step_latency_s",
        "waits nothing after an action",
        "e.g. agent.builtin.step_latency_s=0.5",
    ),
    positive("agent.builtin.http_timeout_s", "e.g. agent.builtin.http_timeout_s=60"),
    positive("agent.builtin.max_tokens", "e.g. agent.builtin.max_tokens=32"),
    Rule(
        "gym.base_url",
        lambda v: "/api/" not in f"{urlsplit(v).path}/",
        "the gym server's root, without /api/v1",
        "e.g. gym.base_url=http://gym:8800 (the client adds /api/v1/{gym_id})",
        bad=("http://127.0.0.1:8800/api/v1/sim",),
    ),
    positive("monitor.heartbeat_s", "e.g. monitor.heartbeat_s=30"),
    non_negative("failfast.window", "turns the check off", "e.g. failfast.window=32"),
    positive("drain.timeout_s", "e.g. drain.timeout_s=20"),
    positive("worker_startup_s", "seconds, e.g. worker_startup_s=300"),
    positive("gateway.max_pause_wait_s", "e.g. gateway.max_pause_wait_s=600"),
    positive("gateway.min_pause_wait_s", "e.g. gateway.min_pause_wait_s=300"),
    positive("actor.mb_spec.max_tokens_per_mb", "tokens of a micro-batch, e.g. 32768"),
    positive("actor.ppo_n_minibatches", "e.g. actor.ppo_n_minibatches=1"),
    *TRAINING_RULES,
    *SECTION_RULES,
)


def _batch_fits_groups(config: Any) -> FieldError | None:
    batch = lookup(config, "train_dataset.batch_size")
    consumer = lookup(config, "rollout.consumer_batch_size")
    if _UNSET in (batch, consumer) or batch == consumer:
        return None
    return FieldError(
        "rollout.consumer_batch_size",
        f"rollout.consumer_batch_size={consumer} but train_dataset.batch_size={batch}: a step "
        "trains the groups of one batch of tasks; set rollout.consumer_batch_size="
        "${train_dataset.batch_size} in the YAML",
    )


def _ordered(low: str, high: str, what: str) -> Callable[[Any], FieldError | None]:
    """``low``'s value must not exceed ``high``'s (both set and numbers)."""

    def rule(config: Any) -> FieldError | None:
        lo, hi = lookup(config, low), lookup(config, high)
        if not all(isinstance(v, int | float) for v in (lo, hi)) or lo <= hi:
            return None
        return FieldError(low, f"{low}={lo} is above {high}={hi}: {what}; lower {low}")

    return rule


def _monitor_target(config: Any) -> FieldError | None:
    if lookup(config, "monitor.enabled") is False:
        return None
    if any(lookup(config, k) for k in ("monitor.base_url", "monitor.db_path")):
        return None
    if os.environ.get("MONITOR_BASE_URL"):
        return None
    return FieldError(
        "monitor.enabled",
        "monitor.enabled is true but neither monitor.base_url, $MONITOR_BASE_URL nor "
        "monitor.db_path is set: point it at a monitor (e.g. monitor.base_url="
        "http://monitor:8000), give an SQLite path for the embedded one, or set "
        "monitor.enabled=false",
    )


# actor.reward_norm / adv_norm: refused by CUAConfig._validate_normalisation (episodes have a
# variable number of rows, AReaL's groups are fixed chunks of rows).
CROSS_RULES: tuple[Callable[[Any], FieldError | None], ...] = (
    _batch_fits_groups,
    _monitor_target,
    _ordered("gconfig.min_new_tokens", "gconfig.max_new_tokens", "no output could be that long"),
    _ordered(
        "eval_gconfig.min_new_tokens", "eval_gconfig.max_new_tokens", "no output could be that long"
    ),
    _ordered(
        "pause.probe_initial_s",
        "pause.probe_max_s",
        "probes start at the first, double to the second",
    ),
)


def lookup(config: Any, key: str) -> Any:
    """The value at ``key`` (``_UNSET`` when a section is absent or a value is missing)."""
    node = config
    for part in key.split("."):
        if node is None:
            return _UNSET
        try:
            node = getattr(node, part)
        except Exception:  # an absent key, or OmegaConf's MissingMandatoryValue
            return _UNSET
    return node


def field_problems(config: Any) -> list[FieldError]:
    """What every row of the table, then every cross-field rule, refuses (all of it)."""
    found = [rule.problem(config) for rule in RULES]
    found += [rule(config) for rule in CROSS_RULES]
    return [p for p in found if p is not None]


def check_fields(config: Any) -> None:
    """``field_problems``, raised: the one problem, or all of them (``ConfigProblems``)."""
    ConfigProblems.raise_for(field_problems(config))


def _folder_keys(config: Any) -> list[tuple[str, bool]]:
    """(key, names a file) of each path the run writes under; a root that only repeats
    cluster.fileroot (``${cluster.fileroot}`` in the shipped configs) is named once."""
    keys = [("cluster.fileroot", False)]
    root = lookup(config, "cluster.fileroot")
    for section in ("stats_logger", "saver", "evaluator", "recover"):
        if lookup(config, f"{section}.fileroot") not in (root, _UNSET, None, ""):
            keys.append((f"{section}.fileroot", False))
    if lookup(config, "cluster.name_resolve.type") == "nfs":
        keys.append(("cluster.name_resolve.nfs_record_root", False))
    embedded = not (lookup(config, "monitor.base_url") or os.environ.get("MONITOR_BASE_URL"))
    if lookup(config, "monitor.enabled") is not False and embedded:
        keys.append(("monitor.db_path", True))
    keys.append(("monitor.spool_path", True))
    return keys


# What the launcher needs beyond a valid config: a model to train. A config may be built
# without one, as a template (configs/local.yaml's is filled in by make demo).
LAUNCH_RULES: tuple[Rule, ...] = (
    non_empty(
        "actor.path",
        "the policy checkpoint (a Hugging Face folder), e.g. actor.path=/models/MAI-UI-8B",
    ),
)


def launch_problems(config: Any, *, needs_model: bool = True) -> list[FieldError]:
    """The launcher's own rows (``needs_model``: a run that loads no model, the audit, skips
    them), then the folders and files the run would create that cannot be, found without
    writing anything."""
    rules = LAUNCH_RULES if needs_model else ()
    found = [p for p in (rule.problem(config) for rule in rules) if p is not None]
    for key, is_file in _folder_keys(config):
        value = lookup(config, key)
        if value in (_UNSET, None, ""):
            continue
        why = why_unwritable(str(value), is_file=is_file)
        if why:
            found.append(
                FieldError(
                    key,
                    f"{key}={value} cannot be created or written: {why}; set {key} to a place "
                    "this user can write",
                )
            )
    return found


def import_workflow(path: str) -> type:
    """The workflow class named by ``workflow:``; a ConfigError says why it does not import."""
    module_name, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise FieldError(
            "workflow",
            f"workflow={path!r}: module {module_name!r} does not import "
            f"({type(exc).__name__}: {exc}); fix the dotted path or PYTHONPATH",
        ) from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise FieldError(
            "workflow",
            f"workflow={path!r}: {module_name} has no class {name!r}; name a class there",
        )
    return cls
