"""Start the inference server a training of this config would start, and keep it running.

    .venv/bin/python -m cua_rl.inference.serve --config configs/local.yaml actor.path=DIR [--port N]

The config is loaded as the launcher loads it (``key=value`` overrides, the CPU harness's changes
with ``cpu: true``), and the server is started as a rollout worker would start it: the
inference environment's interpreter, ``cua_rl.inference.vllm_server`` with the config's
``vllm`` flags, the worker's environment. This process becomes the server (it is replaced, so
stopping it stops the server). Trainings of the same model then borrow it with
``inference.server=HOST:PORT`` (``attach.py``) instead of starting one each: a training loads
its own ``actor.path`` weights into it when it starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from cua_rl.inference.launch import launch_env, server_command

# AReaL's local scheduler gives a worker these thread counts from its SchedulingSpec.cpu; the
# server inherits them from the rollout worker.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def server_launch(config: Any, host: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The command and environment a rollout worker of ``config`` (platform changes applied)
    would start its server with, on ``host:port``."""
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import vLLMConfig

    parallel = ModelAllocation.from_str(config.rollout.backend, name="rollout").parallel
    args = vLLMConfig.build_args(
        vllm_config=config.vllm, tp_size=parallel.tp_size, pp_size=parallel.pp_size
    )
    args.update(host=host, port=port)
    spec = config.rollout.scheduling_spec[0]
    env = {**os.environ, **spec.env_vars}
    for var in THREAD_VARS:
        env.setdefault(var, str(spec.cpu))
    return server_command(args, config.inference.interpreter(config.cpu)), launch_env(env)


def main(argv: list[str] | None = None) -> int:
    from cua_rl.app.train import config_errors, configure_platform, load_config
    from cua_rl.errors import ConfigError

    parser = argparse.ArgumentParser(prog="python -m cua_rl.inference.serve", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(rest, write=False)
        if not config.inference.own(config):
            raise ConfigError(
                f"rollout.backend={config.rollout.backend!r} with inference.environment="
                f"{config.inference.environment!r}: only a vLLM server of our own is served "
                "here; AReaL starts SGLang itself"
            )
        configure_platform(config)
    except ConfigError as exc:
        return config_errors(exc)
    cmd, env = server_launch(config, known.host, known.port)
    print(
        f"serving {config.vllm.model} on {known.host}:{known.port}; train with "
        f"inference.server={known.host}:{known.port}",
        flush=True,
    )
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached: the server replaced this process


if __name__ == "__main__":
    sys.exit(main())
