"""The GPU inference stack a ``cpu: false`` run needs, and ``--check``'s line for it.

AReaL's rollout workers start the inference server named by ``rollout.backend`` from their own
Python environment, so that environment must hold the engine at the version AReaL 1.0.4 was
released against: SGLang 0.5.10.post1 (the ``sglang`` extra in AReaL 1.0.4's metadata, also
asserted by AReaL when it builds SGLang's arguments), or vLLM 0.17.0 (the ``vllm`` extra of
AReaL's vLLM variant, ``pyproject.vllm.toml`` in AReaL's repository; not in the installed
metadata). ``requirements/gpu-<backend>.txt`` pins the same versions for ``make gpu-stack``; a
test keeps the two in step. Neither has been installed or run on a GPU by this project.

The check imports the engine, compares its version and, for vLLM, looks up the engine arguments
the gateway's configuration sets (``vllm.logprobs_mode``, ``vllm.allowed_media_domains``). A
``cpu: true`` run uses the CPU harness's own vLLM build instead and skips it, saying so.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any

from cua_rl.app.check_result import CheckResult


@dataclass(frozen=True)
class Stack:
    backend: str
    version: str
    pinned_by: str
    # Engine arguments the gateway's config sets: (module, class, fields).
    flags: tuple[str, str, tuple[str, ...]] | None = None

    def install(self) -> str:
        return (
            f"make gpu-stack GPU_BACKEND={self.backend} (pip install -r "
            f"requirements/gpu-{self.backend}.txt in the training environment)"
        )


STACKS = {
    "sglang": Stack("sglang", "0.5.10.post1", "AReaL 1.0.4's sglang extra"),
    "vllm": Stack(
        "vllm",
        "0.17.0",
        "AReaL's vLLM variant (pyproject.vllm.toml)",
        ("vllm.engine.arg_utils", "EngineArgs", ("logprobs_mode", "allowed_media_domains")),
    ),
}


def rollout_engine(config: Any) -> str:
    from areal.api.alloc_mode import ModelAllocation

    return ModelAllocation.from_str(config.rollout.backend, name="rollout").backend


def _missing_flags(stack: Stack) -> list[str]:
    if stack.flags is None:
        return []
    module, cls, names = stack.flags
    target = getattr(importlib.import_module(module), cls)
    have = (
        {f.name for f in dataclasses.fields(target)} if dataclasses.is_dataclass(target) else set()
    )
    return [n for n in names if n not in have]


def stack_check(config: Any) -> CheckResult:
    if config.cpu:
        return CheckResult(
            "stack", True,
            "skipped: cpu=true runs the CPU harness's vLLM build (CUA_VLLM_PYTHON, .venv-vllm), "
            "not a GPU inference stack",
        )  # fmt: skip
    engine = rollout_engine(config)
    stack = STACKS.get(engine)
    if stack is None:
        return CheckResult("stack", False, f"rollout.backend={config.rollout.backend!r}: "
                           f"no inference engine named (one of {', '.join(STACKS)})")  # fmt: skip
    where = ""
    if config.scheduler.type == "slurm":
        where = " on this node (Slurm's tasks run in scheduling_spec[0].image: check it there too)"
    try:
        version = importlib.metadata.version(engine)
        importlib.import_module(engine)
        missing = _missing_flags(stack)
    except (ImportError, importlib.metadata.PackageNotFoundError) as exc:
        return CheckResult(
            "stack", False,
            f"rollout.backend={config.rollout.backend} needs {engine}=={stack.version}, not "
            f"importable{where} ({type(exc).__name__}: {exc}): {stack.install()}",
        )  # fmt: skip
    if version != stack.version:
        return CheckResult(
            "stack", False,
            f"{engine} {version}{where}, but this project names {stack.version} "
            f"({stack.pinned_by}): {stack.install()}",
        )  # fmt: skip
    if missing:
        module, cls, _ = stack.flags
        return CheckResult(
            "stack", False,
            f"{engine} {version}: {module}.{cls} lacks {', '.join(missing)}, which the gateway's "
            f"config sets: {stack.install()}",
        )  # fmt: skip
    return CheckResult("stack", True, f"{engine} {version} imports{where} ({stack.pinned_by})")
