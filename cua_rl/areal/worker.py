"""AReaL worker entry point of a cua-rl training: ``python -m cua_rl.areal.worker ARGS``.

AReaL's local and Slurm schedulers start each worker as ``SchedulingSpec.cmd`` plus their own
arguments; Ray ignores the command and runs the job's ``worker_process_setup_hook`` instead
(``ray_setup``). Either way ``apply`` runs in the worker before AReaL's RPC server: SDPA keeps
packed sequences apart (``cua_rl.areal.attention``), and where the trainer named the inference
server's own interpreter (``CUA_VLLM_PYTHON``, ``inference.environment: own``) the rollout
worker starts vLLM with it (``cua_rl.inference.launch``); a server that dies while starting
fails the start at once. The worker ignores SIGINT: Ctrl-C in
the trainer's terminal reaches the whole process group, and the trainer, not the terminal,
stops the workers, after the episodes in flight are drained.
"""

from __future__ import annotations

import os

RAY_SETUP_HOOK = "cua_rl.areal.worker.ray_setup"


def apply(*, loopback: bool = False) -> None:
    from cua_rl.areal.attention import keep_packed_sequences_apart
    from cua_rl.inference.launch import (
        ENV_VLLM_PYTHON,
        fail_fast_on_dead_server,
        serve_from_own_environment,
    )

    keep_packed_sequences_apart()
    fail_fast_on_dead_server()
    if os.environ.get(ENV_VLLM_PYTHON):
        serve_from_own_environment(loopback=loopback)


def ray_setup() -> None:
    """``worker_process_setup_hook`` of a Ray job on GPUs."""
    apply()


def run_areal_worker() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from areal.infra.rpc.rpc_server import main as areal_main

    areal_main()


def main() -> None:
    apply()
    run_areal_worker()


if __name__ == "__main__":
    main()
