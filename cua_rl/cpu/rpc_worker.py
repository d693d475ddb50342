"""AReaL worker entry point for CPU runs: ``python -m cua_rl.cpu.rpc_worker ARGS``.

AReaL's ``LocalScheduler`` starts each worker as ``SchedulingSpec.cmd`` plus its own
arguments (``areal/infra/scheduler/local.py`` ``create_workers``), replacing a leading
``python`` with its own interpreter. This module applies ``cpu.patch_worker()`` (loopback, the
port choice, and the production worker's patches) and then runs AReaL's RPC server unchanged,
as ``cua_rl.areal.worker`` does on a GPU node.
"""

from __future__ import annotations


def main() -> None:
    import sys

    from cua_rl.areal.worker import run_areal_worker
    from cua_rl.cpu.loopback import loopback_argv
    from cua_rl.cpu.training import patch_worker

    # A CPU run is local: the worker binds loopback, not AReaL's 0.0.0.0.
    sys.argv = loopback_argv(sys.argv)
    patch_worker()
    run_areal_worker()


if __name__ == "__main__":
    main()
