"""The AReaL release cua-rl is written against, and every AReaL name it relies on beyond the API.

cua-rl overrides, wraps or replaces a few AReaL members that are not a public API (a method whose
name starts with ``_``, a module global, a method patched on a class or an instance, an attribute
the constructor sets), and calls a few functions by their module path. A new AReaL release may
rename or drop any of them; the failure would then surface deep inside a training (an override
never called, a wrapper never reached), or, read with a default, turn a feature off unnoticed.
So the code reads them directly, and ``check_areal`` looks every one of them up before training
starts and names what is missing. The same holds for the few transformers and torch internals
patched, at the versions AReaL pins.

Adding a reliance on an AReaL internal means adding a ``Reliance`` line here. docs/conventions.md
says how to move to another AReaL release.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

from cua_rl.errors import ConfigError
from cua_rl.logs import get_logger

log = get_logger(__name__)

# The release whose sources the overrides below were read against (fsdp_engine.py, rl_trainer.py,
# vllm_remote.py, remote_inf_engine.py, network.py, stats_logger.py).
SUPPORTED_AREAL = "1.0.4"


@dataclass(frozen=True)
class Reliance:
    """One AReaL name: ``module`` imported, then ``attribute`` (dotted) looked up in it.

    ``set_by``: the attribute is an instance's, assigned (``self.<last part> =``) in that method
    of the class the attribute path names. ``params``: the callable must take these parameters
    (a wrapper passes them on by name).
    """

    module: str
    attribute: str
    use: str  # who relies on it, and how: overrides, wraps, replaces, calls
    set_by: str = ""
    params: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"

    def gap(self, module: object) -> str | None:
        """Why ``module`` does not satisfy this reliance, or None."""
        parts = self.attribute.split(".")
        lookup = parts[:-1] if self.set_by else parts
        obj = module
        for part in lookup:
            if not hasattr(obj, part):
                return f"no {part!r}"
            obj = getattr(obj, part)
        if self.set_by:
            return _assigned_in(obj, self.set_by, parts[-1])
        if self.params:
            try:
                have = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                return "no signature to read"
            lacking = [p for p in self.params if p not in have]
            if lacking:
                return f"does not take {', '.join(lacking)}"
        return None


def _assigned_in(cls: object, method: str, name: str) -> str | None:
    fn = getattr(cls, method, None)
    try:
        source = inspect.getsource(fn)
    except (TypeError, OSError):
        return f"no source for {method} to find self.{name} in"
    if not re.search(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)", source):
        return f"{method} does not set self.{name}"
    return None


_FSDP = "areal.engine.fsdp_engine"
_LOGITS = "cua_rl/areal/logits_engine.py overrides"
_RUNNER = "areal.infra.async_task_runner"
_REMOTE = "areal.infra.remote_inf_engine"
_GATEWAY = "cua_rl/gateway/engine.py calls"
_HOOKS = "cua_rl/areal/hooks.py"
_VISION = "cua_rl/areal/vision_dedup.py"
_CREDIT = "cua_rl/credit/trainer.py"
_VOCAB = "areal.utils.functional.vocab_parallel"
_DYNAMIC = "cua_rl/cpu/training.py compiles its original with dynamic shapes (CPU workers)"

RELIANCES: tuple[Reliance, ...] = (
    # The trainer factory (every fsdp engine is our class); selective logits: six FSDPEngine
    # methods overridden.
    Reliance(_FSDP, "FSDPPPOActor.forward_backward_batch", _LOGITS),
    Reliance(_FSDP, "FSDPPPOActor.forward_batch", _LOGITS),
    Reliance(
        _FSDP,
        "FSDPPPOActor._prepare_mb_inputs",
        _LOGITS + "; " + _VISION + " overrides (takes its micro-batch keys out)",
    ),
    Reliance(_FSDP, "FSDPPPOActor.ppo_update", "areal/actor.py overrides (trims the heap after)"),
    Reliance(
        _FSDP,
        "FSDPPPOActor.compute_advantages",
        "areal/actor.py overrides (each row's own images, not a copy of the batch's per row)",
    ),
    Reliance(_FSDP, "FSDPPPOActor._compute_logprobs", _LOGITS),
    Reliance(_FSDP, "FSDPPPOActor._compute_logprobs_entropy", _LOGITS),
    Reliance(_FSDP, "FSDPPPOActor._get_vocab_min_max_logits", _LOGITS),
    # Step credit (cua_rl/credit/trainer.py): AReaL's per-batch advantages with its own
    # normaliser held back, the step advantages added, then that normaliser applied.
    Reliance(_FSDP, "FSDPPPOActor.actor", _CREDIT + " calls its methods", set_by="__init__"),
    Reliance(
        "areal.trainer.ppo.actor", "PPOActor._compute_advantages", _CREDIT + " calls per batch"
    ),
    Reliance(
        "areal.trainer.ppo.actor",
        "PPOActor.adv_norm",
        _CREDIT + " holds it back and applies it after",
        set_by="__init__",
    ),
    Reliance("areal.utils.data", "batched_call", "cua_rl/areal/actor.py calls (step credit)"),
    # One pass of the vision tower per distinct screenshot (cua_rl/areal/vision_dedup.py).
    Reliance(_FSDP, "FSDPPPOActor._prepare_mb_list", _VISION + " overrides"),
    Reliance(_FSDP, "FSDPPPOActor._create_device_model", _VISION + " overrides (freeze)"),
    Reliance(
        _FSDP, "FSDPEngine.parallel_helper", _VISION + " reads", set_by="create_process_group"
    ),
    Reliance(_FSDP, "FSDPEngine.enable_tree_training", _VISION + " reads", set_by="__init__"),
    Reliance(
        _FSDP,
        "FSDPEngine.device",
        _VISION + " makes its statistics there (NCCL reduces no CPU tensor)",
        set_by="_create_device_model",
    ),
    Reliance("areal.utils.data", "MicroBatchList.forward_indices", _VISION + " reads"),
    Reliance(
        "areal.utils.data",
        "get_allocate_fn",
        "cua_rl/areal/packing.py replaces it while the actor packs micro-batches in row order",
    ),
    Reliance(
        "areal.utils.seqpack",
        "ffd_allocate",
        "cua_rl/areal/packing.py's sequential_allocate takes its parameters",
        params=("values", "capacity", "min_groups", "n_groups_divisor"),
    ),
    Reliance("areal.utils.data", "MicroBatchList.padded_mbs", _VISION + " writes into"),
    Reliance("areal.utils.data", "MicroBatchItem.padded_mb", _VISION + " replaces"),
    Reliance(
        "areal.utils.stats_tracker",
        "DistributedStatsTracker.disable_scope",
        _VISION + " calls (its statistics' keys)",
    ),
    Reliance("areal.utils.stats_tracker", "denominator", _VISION + " calls (summed counts)"),
    *(
        Reliance(
            f"transformers.models.{module}.modeling_{module}",
            f"{model}.visual",
            _VISION + " hooks the tower (grid_thw in, pooler_output / deepstack_features out)",
            set_by="__init__",
        )
        for module, model in (
            ("qwen2_vl", "Qwen2VLModel"),
            ("qwen2_5_vl", "Qwen2_5_VLModel"),
            ("qwen3_vl", "Qwen3VLModel"),
            ("qwen3_vl_moe", "Qwen3VLMoeModel"),
        )
    ),
    *(
        reliance
        for module, tower in (
            ("qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
            ("qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
            ("qwen3_vl", "Qwen3VLVisionModel"),
            ("qwen3_vl_moe", "Qwen3VLMoeVisionModel"),
        )
        for reliance in (
            Reliance(
                f"transformers.models.{module}.modeling_{module}",
                f"{tower}.forward",
                _VISION + " replaces the grid_thw its hook receives",
                params=("grid_thw",),
            ),
            Reliance(
                f"transformers.models.{module}.modeling_{module}",
                f"{tower}.spatial_merge_size",
                _VISION + " reads (patches per merged token, to map placeholder spans)",
                set_by="__init__",
            ),
        )
    ),
    Reliance(
        "transformers.models.qwen3_vl.modeling_qwen3_vl",
        "BaseModelOutputWithDeepstackFeatures.deepstack_features",
        _VISION + " spreads it over the placeholder spans",
    ),
    Reliance("areal", "PPOTrainer._create_train_engine", "cua_rl/areal/actor.py overrides"),
    Reliance("areal", "PPOTrainer._init_scheduler", "cua_rl/areal/actor.py overrides"),
    # No eval rollout worker without eval tasks: the override reads the valid loader, which
    # AReaL's constructor sets before it creates the rollouts.
    Reliance(
        "areal",
        "PPOTrainer._init_rollout",
        "cua_rl/areal/actor.py overrides",
        params=("rollout_config", "is_eval", "lora_path"),
    ),
    Reliance(
        "areal", "PPOTrainer.valid_dataloader", "cua_rl/areal/actor.py reads", set_by="__init__"
    ),
    *(
        Reliance(
            f"areal.infra.scheduler.{module}",
            f"{cls}.startup_timeout",
            "cua_rl/areal/actor.py sets it to worker_startup_s",
            set_by="__init__",
        )
        for module, cls in (
            ("local", "LocalScheduler"),
            ("ray", "RayScheduler"),
            ("slurm", "SlurmScheduler"),
        )
    ),
    *(
        Reliance(
            f"areal.infra.scheduler.{module}",
            f"{cls}._wait_for_fork_ready",
            "cua_rl/areal/actor.py gives it worker_startup_s",
            params=("timeout",),
        )
        for module, cls in (("local", "LocalScheduler"), ("slurm", "SlurmScheduler"))
    ),
    Reliance("areal.utils.functional", "gather_logprobs", "cua_rl/areal/logits_engine.py calls"),
    Reliance(
        "areal.utils.functional", "gather_logprobs_entropy", "cua_rl/areal/logits_engine.py calls"
    ),
    # On CPU, compiled again with dynamic shapes from the first call (cua_rl/cpu/training.py).
    Reliance(_VOCAB, "_gather_logprobs", _DYNAMIC),
    Reliance(_VOCAB, "_gather_logprobs_entropy", _DYNAMIC),
    Reliance("areal.utils.environ", "is_single_controller", "cua_rl/areal/actor.py calls"),
    # A trainer whose construction fails stops the workers it started (cua_rl/areal/actor.py).
    Reliance(
        "areal",
        "PPOTrainer.scheduler",
        "cua_rl/areal/actor.py stops its workers after a failed start",
        set_by="__init__",
    ),
    *(
        Reliance(
            f"areal.infra.scheduler.{module}",
            f"{cls}.delete_workers",
            "cua_rl/areal/actor.py calls after a failed start",
        )
        for module, cls in (
            ("local", "LocalScheduler"),
            ("ray", "RayScheduler"),
            ("slurm", "SlurmScheduler"),
        )
    ),
    # The curriculum's train loader.
    Reliance(
        "areal", "PPOTrainer._create_dataloader", "cua_rl/areal/curriculum_trainer.py overrides"
    ),
    # The monitor's hooks on a step's phases and evals; the launcher's baseline pass.
    Reliance("areal", "PPOTrainer._evaluate_fn", "cua_rl/areal/hooks.py wraps, app/train.py calls"),
    Reliance("areal.utils.stats_logger", "StatsLogger.commit", "cua_rl/areal/hooks.py wraps"),
    Reliance("areal.utils.stats_logger", "StatsLogger.get_log_path", "cua_rl/app/train.py calls"),
    # The free-port draw made independent of the seed (a module global replaced).
    Reliance("areal.utils.network", "random", "cua_rl/areal/ports.py replaces"),
    Reliance("areal.utils.network", "find_free_ports", "cua_rl/areal/ports.py changes the draw of"),
    # vLLM from its own environment (GPU and CPU): the launch and start-up wait replaced in the
    # rollout workers.
    Reliance(
        "areal.engine.vllm_remote",
        "VLLMBackend.launch_server",
        "cua_rl/inference/launch.py replaces",
    ),
    Reliance("areal.engine.vllm_remote", "TRITON_CACHE_PATH", "cua_rl/inference/launch.py reads"),
    Reliance(
        "areal.infra.remote_inf_engine",
        "RemoteInfEngine._wait_for_server",
        "cua_rl/inference/launch.py replaces",
    ),
    Reliance(
        "areal.infra.remote_inf_engine",
        "RemoteInfEngine.check_health",
        "cua_rl/inference/launch.py calls",
    ),
    Reliance("areal.api.cli_args", "get_py_cmd", "cua_rl/inference/launch.py calls"),
    Reliance("areal.infra.rpc.rpc_server", "main", "cua_rl/areal/worker.py calls"),
    Reliance(
        "areal.infra.async_task_runner",
        "AsyncTaskRunner.destroy",
        "cua_rl/rollout/drain.py wraps it on the runner of the runtime's engine (an instance "
        "attribute) to drain the episodes and flush the monitor clients on the runner's loop "
        "(its _loop, paused by its paused event) before the loop stops",
    ),
    Reliance(
        "areal.infra.workflow_executor",
        "WorkflowExecutor.dispatcher",
        "cua_rl/rollout/runtime.py reads it to reach the engine's task runner and install the "
        "drain there",
    ),
    Reliance(
        "areal.infra.workflow_executor",
        "BatchTaskDispatcher.runner",
        "cua_rl/rollout/runtime.py installs the drain on it (the engine's task runner)",
        set_by="__init__",
    ),
    Reliance(
        "areal.infra.remote_inf_engine",
        "GroupedRolloutWorkflow",
        "cua_rl/rollout/drain.py drains its gathered episodes one by one (a cancelled gather "
        "ends with its first child); cua_rl/rollout/workflow.py relies on its arun_episode "
        "calling each episode's arun_episode in its own task, where the group filter is called",
    ),
    Reliance(
        "areal.infra.workflow_executor",
        "WorkflowExecutor._create_workflow_task",
        "cua_rl/rollout/groups.py relies on it calling should_accept_fn in the task that called "
        "arun_episode, whose context holds the runtime's group filter",
    ),
    Reliance(
        _RUNNER,
        "AsyncTaskRunner._loop",
        "cua_rl/rollout/drain.py runs the drain on the runner's loop",
        set_by="__init__",
    ),
    Reliance(
        _RUNNER,
        "AsyncTaskRunner.paused",
        "cua_rl/rollout/drain.py sets it so no episode starts during the drain",
        set_by="__init__",
    ),
    # The engine AReaL hands ``arun_episode`` (the gateway's view of pauses, versions, servers).
    Reliance(
        _REMOTE,
        "RemoteInfEngine.workflow_executor",
        _GATEWAY + "; cua_rl/rollout/runtime.py keeps the rollout runtime on the engine",
    ),
    Reliance(_REMOTE, "RemoteInfEngine.get_version", _GATEWAY),
    Reliance(_REMOTE, "RemoteInfEngine.choose_server", _GATEWAY + ", rollout/workflow.py calls"),
    Reliance("areal.infra.workflow_executor", "WorkflowExecutor.is_paused", _GATEWAY),
    # The monitor's hooks on the trainer and its actor (a controller under every scheduler).
    Reliance("areal", "PPOTrainer.actor", _HOOKS + " wraps its methods", set_by="__init__"),
    Reliance("areal", "PPOTrainer.stats_logger", _HOOKS + " wraps its commit", set_by="__init__"),
    Reliance("areal", "PPOTrainer.recover_info", _HOOKS + " reads", set_by="__init__"),
    Reliance("areal.trainer.ppo.actor", "PPOActorController.ppo_update", _HOOKS + " wraps"),
    Reliance("areal.trainer.ppo.actor", "PPOActorController.update_weights", _HOOKS + " wraps"),
    # Loopback and native Slurm for runs without a GPU cluster.
    Reliance(
        "areal.utils.network",
        "gethostip",
        "cua_rl/cpu/loopback.py and cpu/training.py replace it (and the copies AReaL modules "
        "imported); gateway/server.py calls",
    ),
    Reliance(
        "areal.infra.scheduler.local",
        "LocalScheduler.fork_workers",
        "cua_rl/cpu/loopback.py wraps it, passing command",
        params=("role", "target_role", "command"),
    ),
    Reliance(
        "areal.infra.scheduler.slurm",
        "SlurmScheduler.__init__",
        "cua_rl/cpu/training.py wraps it, defaulting container_type and container_mounts",
        params=("container_type", "container_mounts"),
    ),
    Reliance("areal.engine.vllm_remote", "logger", "cua_rl/inference/launch.py logs to"),
    Reliance("areal.utils.data", "concat_padded_tensors", "cua_rl/trajectory/rows.py calls"),
    # Outside AReaL, at the versions it pins: a correctness fix and the loopback store.
    Reliance(
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
        "Qwen2_5_VLModel.get_vision_position_ids",
        "cua_rl/areal/positions.py wraps (the trainer's Qwen2.5-VL image positions)",
        params=("start_position", "grid_thw", "time_interval"),
    ),
    Reliance(
        "transformers.modeling_utils",
        "ALL_ATTENTION_FUNCTIONS",
        "cua_rl/areal/attention.py replaces its sdpa entry",
    ),
    Reliance(
        "transformers.integrations.sdpa_attention",
        "sdpa_attention_forward",
        "cua_rl/areal/attention.py calls it once per packed sequence",
        params=("module", "query", "key", "value", "attention_mask"),
    ),
    # A checkpointed layer's recompute casts as its forward did (cua_rl/areal/recompute.py):
    # which layers checkpointing wraps, and each FSDP unit's own cast.
    Reliance(
        "transformers.modeling_layers",
        "GradientCheckpointingLayer",
        "cua_rl/areal/recompute.py finds the recomputed layers by",
    ),
    Reliance(
        "torch.distributed.fsdp",
        "FSDPModule._get_fsdp_state",
        "cua_rl/areal/recompute.py calls (a unit's mixed-precision policy)",
    ),
    Reliance(
        "torch.distributed.fsdp._fully_shard._fsdp_state",
        "FSDPState._mp_policy",
        "cua_rl/areal/recompute.py reads",
        set_by="init",
    ),
    Reliance(
        "torch.distributed.fsdp._fully_shard._fsdp_common",
        "_cast_fp_tensor",
        "cua_rl/areal/recompute.py calls (FSDP2's own cast)",
    ),
    Reliance("torch.distributed.utils", "_apply_to_tensors", "cua_rl/areal/recompute.py calls"),
    Reliance("torch.distributed.rendezvous", "_create_c10d_store", "cua_rl/cpu/loopback.py wraps"),
    Reliance(
        "torch.distributed.rendezvous",
        "_torchelastic_use_agent_store",
        "cua_rl/cpu/loopback.py calls",
    ),
)


class ArealMismatch(ConfigError):
    """The installed AReaL lacks names cua-rl relies on; the message lists them."""


def areal_version() -> str:
    try:
        return version("areal")
    except PackageNotFoundError:
        return "not installed"


def check_areal_version() -> None:
    """Refuse to run the selective-logits overrides on a release they were not written against:
    they mirror method bodies, so a release that keeps the names may still change what they do."""
    found = areal_version()
    if found != SUPPORTED_AREAL:
        raise ConfigError(
            f"logits.selective overrides FSDPEngine methods of AReaL {SUPPORTED_AREAL}, and "
            f"AReaL {found} is installed: set logits.selective=false, or check "
            "cua_rl/areal/logits_engine.py against the new fsdp_engine.py and update "
            "SUPPORTED_AREAL in cua_rl/areal/support.py"
        )


def missing(
    reliances: tuple[Reliance, ...] = RELIANCES,
    import_module: Callable[[str], ModuleType] = importlib.import_module,
) -> list[str]:
    """One line per reliance that the installed AReaL does not satisfy."""
    lines = []
    for r in reliances:
        try:
            obj: object = import_module(r.module)
        except ImportError as exc:
            lines.append(f"{r.name} (module does not import: {exc}; {r.use})")
            continue
        gap = r.gap(obj)
        if gap:
            lines.append(f"{r.name} ({gap}; {r.use})")
    return lines


def check_areal(
    reliances: tuple[Reliance, ...] = RELIANCES,
    import_module: Callable[[str], ModuleType] = importlib.import_module,
    found_version: str | None = None,
) -> None:
    """Raise ``ArealMismatch`` naming every AReaL member cua-rl relies on that is missing.

    A different release that still has every name only gets a warning: the launcher's own
    version gate is ``check_areal_version``, for the overrides that mirror AReaL's code.
    """
    found = found_version or areal_version()
    gaps = missing(reliances, import_module)
    if gaps:
        raise ArealMismatch(
            f"cua-rl supports AReaL {SUPPORTED_AREAL}; AReaL {found} is installed and lacks "
            f"{len(gaps)} name(s) cua-rl relies on:\n  "
            + "\n  ".join(gaps)
            + f"\ninstall areal=={SUPPORTED_AREAL}, or port the users named above and update "
            "cua_rl/areal/support.py"
        )
    if found != SUPPORTED_AREAL:
        log.warning(
            "AReaL %s installed, cua-rl is written against %s: every name it relies on is "
            "present, but their behaviour was not re-read",
            found,
            SUPPORTED_AREAL,
        )
