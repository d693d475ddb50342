"""AReaL worker entry point for CPU runs: ``python -m cua_rl.cpu.rpc_worker ARGS``.

AReaL's ``LocalScheduler`` starts each worker as ``SchedulingSpec.cmd`` plus its own
arguments (``areal/infra/scheduler/local.py`` ``create_workers``), replacing a leading
``python`` with its own interpreter. This module applies ``cpu.patch_worker()`` and then
runs AReaL's RPC server unchanged, so the patches live in the process that needs them.
"""

from __future__ import annotations


def main() -> None:
    import sys

    from cua_rl.cpu.loopback import loopback_argv
    from cua_rl.cpu.training import patch_worker

    # A CPU run is local: the worker binds loopback, not AReaL's 0.0.0.0.
    sys.argv = loopback_argv(sys.argv)
    patch_worker()
    from areal.infra.rpc.rpc_server import main as areal_main

    areal_main()


if __name__ == "__main__":
    main()
