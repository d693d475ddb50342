"""The inference stack a run starts, and ``--check``'s line for it.

With ``inference.environment: own`` (the default) the rollout workers start vLLM from its own
environment (``cua_rl.inference``): vLLM 0.32.0, the GPU build in ``.venv-vllm-cuda`` (``make
gpu-stack``, ``requirements/gpu-vllm.txt``) or the CPU build in ``.venv-vllm`` with ``cpu: true``.
The check runs ``cua_rl.inference.probe`` with that environment's interpreter: vLLM and torch
import there, the server module finds every vLLM module it uses, and the server's own parser
takes the flags AReaL builds from the ``vllm:`` section (the gateway's among them:
``enable_scale_out``, ``logprobs_mode``, ``allowed_media_domains``). On a node whose trainer sees
CUDA, torch must see it there too.

With ``inference.environment: areal`` the engine runs from AReaL's environment, this one: it must
import here at the version AReaL 1.0.4 pins (SGLang 0.5.10.post1, its ``sglang`` extra).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Any

from cua_rl.app.check_result import CheckResult, tool_report

PROBE_TIMEOUT_S = 300


@dataclass(frozen=True)
class Stack:
    backend: str
    version: str
    pinned_by: str
    install: str


STACKS = {
    "vllm": Stack(
        "vllm",
        "0.32.0",
        "requirements/gpu-vllm.txt; the CPU build of the same release runs the tests",
        "make gpu-stack (the inference environment .venv-vllm-cuda; docs/gpu.md)",
    ),
    "sglang": Stack(
        "sglang",
        "0.5.10.post1",
        "AReaL 1.0.4's sglang extra",
        "make gpu-stack GPU_BACKEND=sglang GPU_PYTHON=<this environment's python> (AReaL's "
        "image already holds it; docs/gpu.md)",
    ),
}


def rollout_engine(config: Any) -> str:
    from areal.api.alloc_mode import ModelAllocation

    return ModelAllocation.from_str(config.rollout.backend, name="rollout").backend


def server_arguments(config: Any) -> list[str]:
    """The arguments AReaL's launch gives the server for this config (host and port aside)."""
    from areal.api.cli_args import get_py_cmd, vLLMConfig

    args = vLLMConfig.build_args(config.vllm, tp_size=1, pp_size=1, host="127.0.0.1", port=1)
    return get_py_cmd("probe", args)[3:]


def run_probe(python: str, argv: list[str]) -> dict:
    from cua_rl.inference.launch import server_env
    from cua_rl.inference.probe import RESULT_PREFIX

    cmd = [python, "-m", "cua_rl.inference.probe", *argv]
    # --check writes nothing: no bytecode either.
    env = {**server_env(dict(os.environ)), "PYTHONDONTWRITEBYTECODE": "1"}
    report, why = tool_report(cmd, env=env, timeout_s=PROBE_TIMEOUT_S, prefix=RESULT_PREFIX)
    return report if report is not None else {"problems": {"python": why}}


def own_environment_check(config: Any, *, trainer_cuda: bool, probe=None) -> CheckResult:
    """``probe(python, argv)``: the environment's report (default ``run_probe``)."""
    python = config.inference.interpreter(cpu=config.cpu)
    make = "make venv-vllm" if config.cpu else STACKS["vllm"].install
    if not os.path.exists(python):
        return CheckResult("stack", False, f"no inference environment at {python}: {make}")
    report = (probe or run_probe)(python, server_arguments(config))
    problems = report.get("problems", {})
    version = report.get("vllm", "?")
    where = f"vllm {version} in {python}"
    if "python" in problems or "vllm" in problems:
        why = problems.get("python") or problems.get("vllm")
        return CheckResult("stack", False, f"{python}: vLLM does not import ({why}): {make}")
    if "server_module" in problems:
        return CheckResult(
            "stack", False,
            f"{where}: cua_rl.inference.vllm_server does not load ({problems['server_module']}): "
            f"it is written for vllm {STACKS['vllm'].version}: {make}",
        )  # fmt: skip
    if "arguments" in problems:
        return CheckResult(
            "stack", False,
            f"{where} refuses the vllm: section's flags ({problems['arguments']}): drop or fix "
            "that key, or install the pinned vLLM",
        )  # fmt: skip
    if version.split("+")[0] != STACKS["vllm"].version:
        return CheckResult(
            "stack", False, f"{where}, but this project names {STACKS['vllm'].version}: {make}"
        )
    devices = int(report.get("cuda_devices", 0))
    if trainer_cuda and not config.cpu and devices == 0:
        return CheckResult(
            "stack", False,
            f"{where}: its torch {report.get('torch')} sees no GPU while the trainer's does "
            f"(a CPU build of torch or vLLM there?): {make}",
        )  # fmt: skip
    gpus = f"{devices} GPU(s)" if devices else "no GPU"
    return CheckResult(
        "stack", True,
        f"{where} (torch {report.get('torch')}, {gpus}): the server module loads and takes the "
        f"{report.get('arguments', 0)} flags of the vllm: section",
    )  # fmt: skip


def areal_environment_check(config: Any) -> CheckResult:
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
    except (ImportError, importlib.metadata.PackageNotFoundError) as exc:
        return CheckResult(
            "stack", False,
            f"inference.environment=areal runs {engine}=={stack.version} from this environment, "
            f"where it does not import{where} ({type(exc).__name__}: {exc}): {stack.install}",
        )  # fmt: skip
    if version != stack.version:
        return CheckResult(
            "stack", False,
            f"{engine} {version}{where}, but this project names {stack.version} "
            f"({stack.pinned_by}): {stack.install}",
        )  # fmt: skip
    return CheckResult("stack", True, f"{engine} {version} imports{where} ({stack.pinned_by})")


def stack_check(config: Any) -> CheckResult:
    if config.inference.own(config):
        from cua_rl.app.harness import cuda_available

        return own_environment_check(config, trainer_cuda=cuda_available())
    return areal_environment_check(config)
