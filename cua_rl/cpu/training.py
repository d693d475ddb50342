"""Run AReaL 1.0.4's single-controller PPOTrainer on a machine with no GPU.

AReaL already falls back to a CPU platform with gloo (``areal.infra.platforms.cpu``). What
stands between it and a CPU run is the inference server and a few config defaults:

- The rollout worker launches ``python3 -m areal.engine.vllm_ext.areal_vllm_server`` from
  ``PATH`` (``areal/api/cli_args.py`` ``get_py_cmd``, ``areal/engine/vllm_remote.py``
  ``VLLMBackend.launch_server``). vLLM lives in its own interpreter here, and that module does
  not import on vLLM 0.32, so the rollout worker must run ``cua_rl.cpu.vllm_server``
  with ``CUA_VLLM_PYTHON`` instead. Workers are separate processes started by AReaL's
  ``LocalScheduler`` with ``SchedulingSpec.cmd``; pointing ``cmd`` at
  ``cua_rl.cpu.rpc_worker`` gets the patch into them without touching AReaL's files.
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

ENV_VLLM_PYTHON = "CUA_VLLM_PYTHON"
WORKER_CMD = "python -m cua_rl.cpu.rpc_worker"
SERVER_MODULE = "cua_rl.cpu.vllm_server"
WORKER_EXTENSION = "cua_rl.cpu.vllm_worker.DiskWeightReloadExtension"
_AREAL_WORKER_CMD = "python -m areal.infra.rpc.rpc_server"
# Ray ignores SchedulingSpec.cmd: its workers get the patches from this hook (cua_rl.areal.ray_job).
RAY_SETUP_HOOK = "cua_rl.cpu.training.patch_ray_worker"
WORKER_MEM_GIB = 1

# Set in the vLLM server's environment unless already there. The server reloads the whole
# checkpoint after every step and serves prompts of ever new lengths, and its anonymous memory
# rose 2479 -> 3000 MiB over a 60-minute soak. bench/vllm_reload_rss.py (docs/soak.md) measured
# each suspect alone and together: oneDNN's per-shape primitive cache (up to 1024 kernels, each
# with its scratch buffers) filling up was most of it, glibc's raised mmap threshold the rest
# (freed reload buffers left in the arenas); the worker extension's mallopt came too late and in
# one process only, the environment holds it in every process from its start. Neither alone
# stayed flat; both together did.
SERVER_ENV_DEFAULTS = {
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
    "MALLOC_MMAP_THRESHOLD_": "131072",
}

# Folder that holds the cua_rl package: the vLLM interpreter needs it on PYTHONPATH to import
# the server module and the worker extension.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def default_vllm_python() -> str:
    """``CUA_VLLM_PYTHON`` if set, else the repository's ``.venv-vllm/bin/python``."""
    env = os.environ.get(ENV_VLLM_PYTHON)
    if env:
        return env
    return str(Path(_PACKAGE_ROOT) / ".venv-vllm" / "bin" / "python")


def server_env(base: dict[str, str]) -> dict[str, str]:
    """The vLLM server's environment, derived from the rollout worker's.

    The worker's PYTHONPATH lists the trainer venv's site-packages (AReaL copies the
    controller's sys.path into it); inherited by the vLLM interpreter it would import the
    trainer's torch and transformers. The server gets only the folder holding cua_rl, and
    ``SERVER_ENV_DEFAULTS`` (its memory stays flat over reloads) unless the worker sets them.
    """
    env = dict(base)
    env["PYTHONPATH"] = _PACKAGE_ROOT
    for var in ("PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(var, None)
    for var, value in SERVER_ENV_DEFAULTS.items():
        env.setdefault(var, value)
    return env


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
    changes: list[str] = []
    vllm_python = vllm_python or default_vllm_python()
    if not Path(vllm_python).exists():
        raise ConfigError(
            f"vLLM interpreter {vllm_python} does not exist: run `make venv-vllm` or set {ENV_VLLM_PYTHON}"
        )
    _refuse_what_cpu_cannot_run(config, vllm_python)
    scheduler = getattr(config.scheduler, "type", None)

    setattr_logged = functools.partial(_setattr_logged, changes)

    # No NCCL: weights go through a checkpoint folder and /areal_update_weights.
    setattr_logged(config.actor, "weight_update_mode", "disk", "actor")
    # Our extension needs no AReaL inside the vLLM interpreter.
    setattr_logged(config.vllm, "worker_extension_cls", WORKER_EXTENSION, "vllm")
    if config.vllm.block_size % 32:
        # AReaL's default 16 kills vLLM CPU's engine core: "No common block size for 16
        # (CPU_ATTN: [MultipleOf(32)])".
        setattr_logged(config.vllm, "block_size", 32, "vllm")
    roles = [("actor", config.actor), ("rollout", config.rollout)]
    for name in ("ref", "critic"):
        if getattr(config, name, None) is not None:
            roles.append((name, getattr(config, name)))
    for role, section in roles:
        if hasattr(section, "attn_impl") and section.attn_impl.startswith("flash"):
            # flash-attn kernels are CUDA-only; sdpa has a CPU path (made packing-aware by
            # patch_packed_attention in the workers).
            setattr_logged(section, "attn_impl", "sdpa", role)
        for i, spec in enumerate(section.scheduling_spec):
            where = f"{role}.scheduling_spec[{i}]"
            _cpu_worker_spec(spec, where, changes, scheduler, vllm_python, threads_per_worker)
    if config.enable_offload:
        # torch_memory_saver offload is CUDA-only.
        setattr_logged(config, "enable_offload", False, "config")
    return changes


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
    vllm_python: str,
    threads_per_worker: int,
) -> None:
    """One worker's ``SchedulingSpec`` for CPU: our worker command, no GPU, few threads, the
    vLLM interpreter and CPU settings in its environment (exported too under Slurm)."""
    if spec.cmd in (None, _AREAL_WORKER_CMD):
        _setattr_logged(changes, spec, "cmd", WORKER_CMD, where)
    elif "cua_rl.cpu.rpc_worker" not in spec.cmd:
        raise ConfigError(
            f"{where}.cmd={spec.cmd!r}: workers must start with {WORKER_CMD!r} on CPU "
            "(it applies the worker-side patches)"
        )
    if spec.gpu:
        _setattr_logged(changes, spec, "gpu", 0, where)
    # SchedulingSpec.cpu becomes OMP_NUM_THREADS; the default (8) oversubscribes a small box.
    _setattr_logged(changes, spec, "cpu", threads_per_worker, where)
    if scheduler in ("ray", "slurm"):
        # Ray and Slurm reserve SchedulingSpec.mem (GiB, default 32) per worker: more
        # than a small node offers, so the worker would never be scheduled.
        _setattr_logged(changes, spec, "mem", WORKER_MEM_GIB, where)
    env = dict(spec.env_vars)
    # Read by patch_worker() in the rollout worker, whose environment the server
    # inherits (filtered by server_env). No PYTHONPATH here: AReaL builds
    # the workers' PYTHONPATH from the controller's sys.path (launcher.get_env_vars).
    env[ENV_VLLM_PYTHON] = vllm_python
    # A tiny model needs a tiny KV cache; vLLM CPU's default is 4 GiB.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM CPU pins its engine to cores by default; on a shared small box let the OS place it.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if env != spec.env_vars:
        spec.env_vars = env
        changes.append(
            f"{where}.env_vars: {ENV_VLLM_PYTHON}, VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND"
        )
    if scheduler == "slurm":
        # AReaL's Slurm scheduler passes env_vars only into an Apptainer container; a
        # native task (native_slurm) gets them as exports before its command.
        exports = [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()]
        bash = list(spec.additional_bash_cmds or [])
        if bash[: len(exports)] != exports:
            spec.additional_bash_cmds = exports + bash
            changes.append(f"{where}.additional_bash_cmds: export the env_vars")


def _refuse_what_cpu_cannot_run(config: Any, vllm_python: str) -> None:
    if any(c in vllm_python for c in ",="):
        # AReaL passes env_vars to workers as "K=V,K=V" and splits on both characters.
        raise ConfigError(f"vLLM interpreter path {vllm_python!r} contains ',' or '=': move it")
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


def server_command(args: dict[str, Any], vllm_python: str | None = None) -> list[str]:
    """The command that replaces AReaL's ``python3 -m areal.engine.vllm_ext.areal_vllm_server``."""
    from areal.api.cli_args import get_py_cmd

    cmd = get_py_cmd(SERVER_MODULE, args)
    cmd[0] = vllm_python or default_vllm_python()
    return cmd


def packed_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention that keeps packed sequences apart.

    AReaL's FSDP engine packs a micro-batch into one row and passes the boundaries as
    ``cu_seq_lens_q/k`` with ``attention_mask={"full_attention": None, ...}``
    (``areal/engine/fsdp_engine.py`` ``_prepare_mb_list``). flash_attention_2 reads those
    boundaries; SDPA and eager ignore them and run one causal attention over the whole row, so
    every sequence after the first attends to the ones before it. On the tiny Qwen2 that moved
    the second sequence's logprobs by up to 0.94 nats. Here the boundaries become a
    block-diagonal causal mask (padding after the last boundary is its own block).
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None and attention_mask is None and query.shape[0] == 1 and query.shape[2] > 1:
        length = query.shape[2]
        cu = cu.to(device=query.device, dtype=torch.long)
        seq_id = torch.full((length,), len(cu), dtype=torch.long, device=query.device)
        for i in range(len(cu) - 1):
            seq_id[cu[i] : cu[i + 1]] = i
        same = seq_id[:, None] == seq_id[None, :]
        causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
        attention_mask = (same & causal)[None, None]
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def patch_packed_attention() -> None:
    """Make ``attn_implementation="sdpa"`` respect AReaL's packed sequence boundaries."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = packed_sdpa_attention


def patch_worker() -> None:
    """Patches applied inside every AReaL worker process (see ``rpc_worker``)."""
    from cua_rl.areal.ports import unseed_port_choice
    from cua_rl.cpu.loopback import bind_loopback

    bind_loopback()
    patch_packed_attention()
    unseed_port_choice()
    import time
    import uuid

    from areal.engine import vllm_remote
    from areal.infra import remote_inf_engine

    def launch_server(self, server_args: dict[str, Any]):
        # Same as VLLMBackend.launch_server (areal/engine/vllm_remote.py) except the interpreter
        # and the module: AReaL's literal `python3 -m areal...areal_vllm_server` would resolve
        # to the trainer's Python and a module that does not import on vLLM 0.32.
        import subprocess

        # RemoteInfEngine.launch_server (areal/infra/remote_inf_engine.py) fills host with
        # gethostip(), the machine's first non-loopback address, and reads it back from this
        # same dict after we return. Every caller is on this machine: keep the server on loopback.
        server_args["host"] = "127.0.0.1"
        cmd = server_command(server_args)
        env = server_env(os.environ)
        triton_cache = env.get("TRITON_CACHE_PATH", vllm_remote.TRITON_CACHE_PATH)
        env["TRITON_CACHE_PATH"] = os.path.join(triton_cache, str(uuid.uuid4()))
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        vllm_remote.logger.info("Launching vLLM (CPU) server: %s", shlex.join(cmd))
        return subprocess.Popen(cmd, env=env, stdout=sys.stdout, stderr=sys.stdout)

    def wait_for_server(self, address: str, process=None):
        # AReaL's _wait_for_server never looks at the process: a server that dies while
        # starting (bad flag, unsupported block size) is only noticed after
        # rollout.setup_timeout. Fail as soon as it exits, with its exit code.
        deadline = time.monotonic() + self.config.setup_timeout
        base_url = f"http://{address}"
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(
                    f"inference server exited with code {process.returncode} while starting; "
                    "its log is in the rollout worker's log (fileroot/logs/.../rollout.log)"
                )
            if self.check_health(base_url):
                return
            time.sleep(1)
        raise TimeoutError(
            f"inference server at {address} not healthy after {self.config.setup_timeout}s"
        )

    vllm_remote.VLLMBackend.launch_server = launch_server
    remote_inf_engine.RemoteInfEngine._wait_for_server = wait_for_server


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
