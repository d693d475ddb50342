"""AReaL worker entry point for CPU runs: ``python -m cua_rl.cpu.rpc_worker ARGS``.

AReaL's ``LocalScheduler`` starts each worker as ``SchedulingSpec.cmd`` plus its own
arguments (``areal/infra/scheduler/local.py`` ``create_workers``), replacing a leading
``python`` with its own interpreter. This module applies ``cpu.patch_worker()`` and then
runs AReaL's RPC server unchanged, so the patches live in the process that needs them. It
ignores SIGINT: the trainer, not a terminal's Ctrl-C, stops the workers, after the drain.
"""

from __future__ import annotations


def main() -> None:
    import signal
    import sys

    from cua_rl.cpu.loopback import loopback_argv

    # Ctrl-C in the terminal of ``train.py`` reaches its whole process group, AReaL's workers
    # included. The trainer ends the run: it destroys the rollout engine (episodes in flight are
    # drained, docs/design.md) before its scheduler stops the workers. A worker that stopped on
    # its own at the same time would be killed mid-drain by that scheduler 3 s later.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from cua_rl.cpu.training import patch_worker

    # A CPU run is local: the worker binds loopback, not AReaL's 0.0.0.0.
    sys.argv = loopback_argv(sys.argv)
    patch_worker()
    from areal.infra.rpc.rpc_server import main as areal_main

    areal_main()


if __name__ == "__main__":
    main()
