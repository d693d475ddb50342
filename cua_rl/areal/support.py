"""The AReaL release cua-rl is written against, and every AReaL name it relies on beyond the API.

cua-rl overrides, wraps or replaces a few AReaL members that are not a public API (a method whose
name starts with ``_``, a module global, a method patched on an instance), and calls a few
functions by their module path. A new AReaL release may rename or drop any of them; the failure
would then surface deep inside a training (an override never called, a wrapper never reached).
``check_areal`` looks every one of them up before training starts and names what is missing.

Adding a reliance on an AReaL internal means adding a ``Reliance`` line here. docs/conventions.md
says how to move to another AReaL release.
"""

from __future__ import annotations

import importlib
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
    """One AReaL name: ``module`` imported, then ``attribute`` (dotted) looked up in it."""

    module: str
    attribute: str
    use: str  # who relies on it, and how: overrides, wraps, replaces, calls

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"


_FSDP = "areal.engine.fsdp_engine"
_LOGITS = "cua_rl/areal/logits_engine.py overrides"

RELIANCES: tuple[Reliance, ...] = (
    # Selective logits: six FSDPEngine methods overridden, one trainer factory extended.
    Reliance(_FSDP, "FSDPPPOActor.forward_backward_batch", _LOGITS),
    Reliance(_FSDP, "FSDPPPOActor.forward_batch", _LOGITS),
    Reliance(_FSDP, "FSDPPPOActor._prepare_mb_inputs", _LOGITS),
    Reliance(_FSDP, "FSDPPPOActor._compute_logprobs", _LOGITS),
    Reliance(_FSDP, "FSDPPPOActor._compute_logprobs_entropy", _LOGITS),
    Reliance(_FSDP, "FSDPPPOActor._get_vocab_min_max_logits", _LOGITS),
    Reliance("areal", "PPOTrainer._create_train_engine", _LOGITS),
    Reliance("areal.utils.functional", "gather_logprobs", "cua_rl/areal/logits_engine.py calls"),
    Reliance(
        "areal.utils.functional", "gather_logprobs_entropy", "cua_rl/areal/logits_engine.py calls"
    ),
    Reliance("areal.utils.environ", "is_single_controller", "cua_rl/areal/logits_engine.py calls"),
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
    # The no-GPU harness: the vLLM server's launch and start-up wait replaced in the workers.
    Reliance(
        "areal.engine.vllm_remote", "VLLMBackend.launch_server", "cua_rl/cpu/training.py replaces"
    ),
    Reliance("areal.engine.vllm_remote", "TRITON_CACHE_PATH", "cua_rl/cpu/training.py reads"),
    Reliance(
        "areal.infra.remote_inf_engine",
        "RemoteInfEngine._wait_for_server",
        "cua_rl/cpu/training.py replaces",
    ),
    Reliance(
        "areal.infra.remote_inf_engine",
        "RemoteInfEngine.check_health",
        "cua_rl/cpu/training.py calls",
    ),
    Reliance("areal.api.cli_args", "get_py_cmd", "cua_rl/cpu/training.py calls"),
    Reliance("areal.infra.rpc.rpc_server", "main", "cua_rl/cpu/rpc_worker.py calls"),
    Reliance(
        "areal.infra.async_task_runner",
        "AsyncTaskRunner.destroy",
        "cua_rl/rollout/drain.py wraps it to drain the episodes and flush the monitor clients "
        "on the runner's loop (its _loop, paused by its paused event) before the loop stops",
    ),
    Reliance(
        "areal.infra.remote_inf_engine",
        "GroupedRolloutWorkflow",
        "cua_rl/rollout/drain.py drains its gathered episodes one by one (a cancelled gather "
        "ends with its first child)",
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
        for part in r.attribute.split("."):
            if not hasattr(obj, part):
                lines.append(f"{r.name} (no {part!r}; {r.use})")
                break
            obj = getattr(obj, part)
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
