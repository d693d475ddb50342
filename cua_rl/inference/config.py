"""``inference:``: where the rollout workers start the inference server from.

``auto`` (the default) is ``own`` for a vLLM rollout backend and ``areal`` for SGLang. ``own``:
vLLM in an environment of its own, started by the rollout worker with
that environment's interpreter (``cua_rl.inference.launch``); the trainer's environment stays
AReaL's, pins and all. ``areal``: AReaL's own launch from the worker's environment, which must
then hold the engine at AReaL's version (AReaL's image with SGLang); the one way to NCCL
(``xccl``) weight updates. docs/gpu.md has the environments and their install commands.

``server`` points the rollout worker at a running server instead (``attach.py``): the training
borrows it, loading ``actor.path``'s weights into it first; ``python -m cua_rl.inference.serve``
starts one with the flags the config's own launch would give it.

``use_own_environment`` is the trainer's side: every worker starts through a command that
applies the worker-side launch (``cua_rl.areal.worker``), with the interpreter in its
environment, and weights go through disk. It returns one line per change, as the CPU harness
does; the monitor records the config after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError
from cua_rl.inference.launch import (
    ENV_SERVER,
    ENV_VLLM_PYTHON,
    WORKER_EXTENSION,
    own_environment_env,
    resolve_python,
)

ENVIRONMENTS = ("auto", "own", "areal")
AREAL_WORKER_CMD = "python -m areal.infra.rpc.rpc_server"
WORKER_CMD = "python -m cua_rl.areal.worker"


@dataclass
class InferenceSection:
    environment: str = doc(
        "auto",
        "Where the rollout workers start the inference server from. auto: own for "
        "rollout.backend=vllm:..., areal for sglang:.... own: vLLM's own "
        "environment (inference.python), running cua_rl.inference.vllm_server; the weights go "
        "through disk (actor.weight_update_mode=disk). areal: AReaL's own launch from the "
        "workers' environment, which must then hold the engine (AReaL's image with SGLang, "
        "rollout.backend=sglang:...); needed for xccl weight updates.",
    )
    python: str = doc(
        "",
        "The inference environment's interpreter (environment=own). Empty: $CUA_VLLM_PYTHON, "
        "else the repository's .venv-vllm-cuda/bin/python (make gpu-stack), or .venv-vllm/bin/"
        "python with cpu=true. A relative path is taken from the repository root.",
    )

    server: str = doc(
        "",
        "host:port of a running inference server for the rollout worker to borrow instead of "
        "starting its own (environment=own, rollout.backend=vllm:d1): cua_rl.inference."
        "vllm_server started with this config's vllm flags, as `python -m cua_rl.inference."
        "serve --config FILE` does. The training loads actor.path's weights into it and clears "
        "its version label when it starts, and gives it back, still running, when it ends; one "
        "training at a time (another is refused while one holds it). Saves the server's "
        "start-up when trainings follow each other (tests, debugging). Empty: start one.",
    )

    def interpreter(self, cpu: bool) -> str:
        return resolve_python(self.python, cpu)

    def own(self, config: Any) -> bool:
        """Whether the server runs from its own environment (``auto`` resolved by the engine)."""
        if self.environment == "auto":
            return str(config.rollout.backend).startswith("vllm:")
        return self.environment == "own"

    def check(self, config: Any) -> None:
        """The section against the rest of the config; each message says how to fix it."""
        if self.environment not in ENVIRONMENTS:
            raise ConfigError(
                f"inference.environment={self.environment!r}; use auto (the default), own (vLLM "
                "in its own environment) or areal (AReaL's launch, from the workers' environment)"
            )
        if any(c in self.python for c in ",="):
            # AReaL passes env_vars to workers as "K=V,K=V" and splits on both characters.
            raise ConfigError(
                f"inference.python={self.python!r} contains ',' or '=': move the environment"
            )
        if self.server:
            self._check_server(config)
        if not self.own(config):
            return
        backend = str(config.rollout.backend)
        if not backend.startswith("vllm:"):
            raise ConfigError(
                f"rollout.backend={backend!r} with inference.environment=own: only vLLM runs "
                "from an environment of its own; set rollout.backend=vllm:d<N>, or "
                "inference.environment=areal with the engine installed in AReaL's environment "
                "(docs/gpu.md)"
            )
        # The CPU harness sets disk itself (cua_rl/cpu/training.py).
        if not config.cpu and config.actor.weight_update_mode != "disk":
            raise ConfigError(
                f"actor.weight_update_mode={config.actor.weight_update_mode!r} with "
                "inference.environment=own: the server's environment has no AReaL, so no NCCL "
                "weight routes; set actor.weight_update_mode=disk, or inference.environment="
                "areal with the engine installed in AReaL's environment (docs/gpu.md)"
            )

    def _check_server(self, config: Any) -> None:
        from cua_rl.inference.attach import split_address

        try:
            split_address(self.server)
        except ValueError as exc:
            raise ConfigError(
                f"inference.server={self.server!r}: {exc}; give the server as host:port, e.g. "
                "127.0.0.1:8000"
            ) from None
        if not self.own(config):
            raise ConfigError(
                f"inference.server={self.server!r} with inference.environment="
                f"{self.environment!r} and rollout.backend={config.rollout.backend!r}: only a "
                "vLLM server of our own (environment own, rollout.backend=vllm:d1) can be "
                "borrowed; clear inference.server to start one"
            )
        backend = str(config.rollout.backend)
        if backend != "vllm:d1":
            raise ConfigError(
                f"inference.server={self.server!r} with rollout.backend={backend!r}: one "
                "borrowed server serves one rollout worker; set rollout.backend=vllm:d1, or "
                "clear inference.server to start a server per worker"
            )


def use_own_environment(
    config: Any, vllm_python: str, *, worker_cmd: str = WORKER_CMD, allowed: tuple[str, ...] = ()
) -> list[str]:
    """Make every worker start through ``worker_cmd`` with ``vllm_python`` in its environment,
    and the server load our worker extension; one line per change. With ``inference.server``
    the rollout workers get that address too (they borrow it instead of starting a server).

    AReaL's default command and cua-rl's GPU one become ``worker_cmd``; any other command that
    is not ``worker_cmd`` and contains none of ``allowed`` is refused: the launch would not be
    replaced in that worker.
    """
    changes: list[str] = []
    section = getattr(config, "inference", None)  # AReaL's own config has none
    server = section.server if section is not None else ""
    extension = config.vllm.worker_extension_cls
    if extension != WORKER_EXTENSION:
        config.vllm.worker_extension_cls = WORKER_EXTENSION
        changes.append(f"vllm.worker_extension_cls: {extension!r} -> {WORKER_EXTENSION!r}")
    for role, section in worker_sections(config):
        for i, spec in enumerate(section.scheduling_spec):
            where = f"{role}.scheduling_spec[{i}]"
            if spec.cmd in (None, AREAL_WORKER_CMD, WORKER_CMD) and spec.cmd != worker_cmd:
                changes.append(f"{where}.cmd: {spec.cmd!r} -> {worker_cmd!r}")
                spec.cmd = worker_cmd
            elif spec.cmd != worker_cmd and not any(a in spec.cmd for a in allowed):
                raise ConfigError(
                    f"{where}.cmd={spec.cmd!r}: workers must start with {worker_cmd!r} (it "
                    "starts the inference server from its own environment); set it so, or "
                    "inference.environment=areal"
                )
            before = dict(spec.env_vars)
            if own_environment_env(spec, vllm_python, server if role == "rollout" else ""):
                changes += [
                    f"{where}.env_vars: {var}={value}"
                    for var, value in spec.env_vars.items()
                    if var in (ENV_VLLM_PYTHON, ENV_SERVER) and before.get(var) != value
                ]
    return changes


def worker_sections(config: Any) -> list[tuple[str, Any]]:
    """The config sections whose ``scheduling_spec`` starts AReaL workers."""
    roles = [("actor", config.actor), ("rollout", config.rollout)]
    for name in ("ref", "critic"):
        if getattr(config, name, None) is not None:
            roles.append((name, getattr(config, name)))
    return roles
