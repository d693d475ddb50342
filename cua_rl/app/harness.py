"""Whether this run uses the CPU harness (``cua_rl/cpu``): the config says so, never the CUDA of
the trainer's machine; and the one place the product starts it.

Under ``scheduler.type=ray`` or ``slurm`` the trainer (controller) only schedules: it usually
runs on a login or head node without a GPU while AReaL's workers get the GPUs, so a missing CUDA
there says nothing about the run. ``cpu: true`` (``configs/local.yaml``, hence ``make demo`` and
``make learn``) selects the harness; ``cpu: false`` is AReaL's GPU path, and under the local
scheduler, where the workers are this machine's children, it needs CUDA here: without it the run
stops at start instead of turning into a CPU run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cua_rl.errors import ConfigError


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def use_cpu_harness(config: Any, cuda: bool) -> bool:
    """True for the CPU harness; raises ConfigError for a local GPU run on a machine without CUDA."""
    if config.cpu:
        return True
    if config.scheduler.type == "local" and not cuda:
        raise ConfigError(
            "cpu=false with scheduler.type=local needs CUDA on this machine, and torch sees none "
            "(torch.cuda.is_available() is false: no NVIDIA driver, a CPU-only torch, or "
            "CUDA_VISIBLE_DEVICES empty or hiding the GPUs): fix that, or set cpu=true to run "
            "the CPU harness (configs/local.yaml)"
        )
    return False


# The product's one door into the harness (tests/common/test_harness_imports.py): the launcher
# calls these only with ``cpu: true``, and nothing else of the product imports cua_rl.cpu.


def start_cpu_harness(config: Any) -> None:
    """Fit the config and this process to AReaL's CPU path (docs/areal-cpu.md), in place."""
    from cua_rl.cpu.training import enable_cpu_training, native_slurm

    enable_cpu_training(config)
    if config.scheduler.type == "slurm":
        native_slurm()
    if config.scheduler.type == "local":
        from cua_rl.cpu.warm_start import start_workers_warm

        start_workers_warm(config.warm_start_workers, model=config.model_path())


def connect_cpu_harness_to_ray(connect: Callable[..., str]) -> None:
    """``connect`` (``cua_rl.areal.ray_job.connect``) to a Ray cluster on this machine: the
    harness's worker patches as the job's setup hook, addresses kept on loopback."""
    from cua_rl.cpu.ray_cluster import keep_loopback
    from cua_rl.cpu.training import RAY_SETUP_HOOK, pin_host_ip

    connect(RAY_SETUP_HOOK, prepare=keep_loopback)
    import ray

    pin_host_ip(ray.util.get_node_ip_address())
