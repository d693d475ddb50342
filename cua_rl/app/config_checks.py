"""Range and consistency checks of the training config, one table row per field.

Each ``Rule`` names a dotted key, what its value must be, and the fix; a new field gets its check
by adding a row. The rules read the config through attribute access only, so they run on the
merged ``DictConfig`` before AReaL builds its dataclasses (pre-empting AReaL's own, less precise
errors: ``gconfig.n_samples=-1`` otherwise fails as a group-normalisation error) and again on
the built ``CUAConfig`` (for callers of AReaL's ``load_expr_config``). ``FieldError`` carries the
key, so the loader can say whether the file or the command line set it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from cua_rl.agent.loop import IMAGE_MODES
from cua_rl.errors import ConfigError
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

    def check(self, config: Any) -> None:
        value = lookup(config, self.key)
        if value is _UNSET or value is None:
            return
        if self.when is not None and not self.when(config):
            return
        try:
            good = self.ok(value)
        except TypeError:
            good = False
        if not good:
            raise FieldError(self.key, f"{self.key}={value!r} must be {self.must}; {self.fix}")


def positive(key: str, fix: str) -> Rule:
    return Rule(key, lambda v: v > 0, "> 0", fix, bad=(0, -1))


def non_negative(key: str, off: str, fix: str) -> Rule:
    return Rule(key, lambda v: v >= 0, f">= 0 (0 {off})", fix, bad=(-1,))


def one_of(key: str, choices: tuple[str, ...], fix: str) -> Rule:
    return Rule(key, lambda v: v in choices, f"one of {', '.join(choices)}", fix, bad=("other",))


def non_empty(key: str, fix: str, when: Callable[[Any], bool] | None = None) -> Rule:
    return Rule(
        key, lambda v: bool(str(v).strip()), "set (it is required)", fix, bad=("",), when=when
    )


def _agent_service(config: Any) -> bool:
    """Whether episodes run on an agent service (``agent.mode: service``, the default)."""
    return lookup(config, "agent.mode") in (_UNSET, None, "service")


RULES: tuple[Rule, ...] = (
    positive("train_dataset.batch_size", "tasks per step, e.g. train_dataset.batch_size=8"),
    positive("valid_dataset.batch_size", "e.g. valid_dataset.batch_size=8"),
    positive("total_train_epochs", "e.g. total_train_epochs=10"),
    non_negative(
        "total_train_steps",
        "evaluates actor.path on the eval split without training",
        "e.g. total_train_steps=100, or null for the epochs' count",
    ),
    positive(
        "rollout.max_concurrent_rollouts",
        "each rollout holds a gym box and an agent run: e.g. rollout.max_concurrent_rollouts=32",
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
)


def _batch_fits_groups(config: Any) -> None:
    batch = lookup(config, "train_dataset.batch_size")
    consumer = lookup(config, "rollout.consumer_batch_size")
    if _UNSET in (batch, consumer) or batch == consumer:
        return
    raise FieldError(
        "rollout.consumer_batch_size",
        f"rollout.consumer_batch_size={consumer} but train_dataset.batch_size={batch}: a step "
        "trains the groups of one batch of tasks; set rollout.consumer_batch_size="
        "${train_dataset.batch_size} in the YAML",
    )


# actor.reward_norm / adv_norm: refused by CUAConfig._validate_normalisation (episodes have a
# variable number of rows, AReaL's groups are fixed chunks of rows).
CROSS_RULES: tuple[Callable[[Any], None], ...] = (_batch_fits_groups,)


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


def check_fields(config: Any) -> None:
    """Every row of the table, then the cross-field rules; the first failure raises."""
    for rule in RULES:
        rule.check(config)
    for rule in CROSS_RULES:
        rule(config)


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
