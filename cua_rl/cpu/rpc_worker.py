"""AReaL worker entry point for CPU runs: ``python -m cua_rl.cpu.rpc_worker ARGS``.

AReaL's ``LocalScheduler`` starts each worker as ``SchedulingSpec.cmd`` plus its own
arguments (``areal/infra/scheduler/local.py`` ``create_workers``), replacing a leading
``python`` with its own interpreter. This module applies ``cpu.patch_worker()`` (loopback, the
port choice, and the production worker's patches) and then runs AReaL's RPC server unchanged,
as ``cua_rl.areal.worker`` does on a GPU node. Where the trainer started a warm-start zygote
(``CUA_RL_ZYGOTE``: ``cua_rl.cpu.warm_start``), this process hands the worker's start to it and
stands in for the forked worker until it ends.
"""

from __future__ import annotations


def run_worker() -> None:
    """The worker itself: in this process (a cold start) or in a fork of the run's zygote."""
    import sys

    from cua_rl.areal.worker import run_areal_worker
    from cua_rl.cpu.loopback import loopback_argv
    from cua_rl.cpu.training import patch_worker

    # A CPU run is local: the worker binds loopback, not AReaL's 0.0.0.0.
    sys.argv = loopback_argv(sys.argv)
    patch_worker()
    run_areal_worker()


def main() -> None:
    from cua_rl.cpu.warm_start import ENV_ZYGOTE, hand_over

    hand_over(ENV_ZYGOTE, "worker")
    run_worker()


if __name__ == "__main__":
    main()
