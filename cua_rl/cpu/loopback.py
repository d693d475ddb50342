"""Keep a local run's AReaL servers on loopback.

AReaL 1.0.4 picks the address its servers advertise with ``areal.utils.network.gethostip()``
(the machine's first non-loopback address) and starts every RPC worker with ``--host 0.0.0.0``
(``areal/infra/scheduler/local.py``). Its RPC server runs whatever engine call it is sent,
without authentication, so a run on a laptop would take orders from the whole LAN. A local run
is one machine: every ``gethostip`` AReaL has imported answers 127.0.0.1, and the RPC worker
binds there (``rpc_worker`` rewrites ``--host``). A cluster run does not call this.
"""

from __future__ import annotations

import sys

LOOPBACK = "127.0.0.1"


def loopback_ip(*_args, **_kwargs) -> str:
    return LOOPBACK


def bind_loopback() -> None:
    """Make ``gethostip`` answer loopback in AReaL's network module and every module that has
    already imported it by name (``from areal.utils.network import gethostip``)."""
    import areal.utils.network as network

    original = network.gethostip
    network.gethostip = loopback_ip
    for name, module in list(sys.modules.items()):
        if name.startswith("areal") and getattr(module, "gethostip", None) is original:
            module.gethostip = loopback_ip


def fork_our_worker() -> None:
    """Forked workers (the eval rollout) run ``cua_rl.cpu.rpc_worker`` rather than AReaL's
    ``rpc_server``, whose fresh process would bind 0.0.0.0 and advertise the LAN address."""
    from areal.infra.scheduler.local import LocalScheduler

    fork = LocalScheduler.fork_workers
    if getattr(fork, "_cua_loopback", False):
        return

    def fork_workers(self, role, target_role, command=None):
        return fork(self, role, target_role, command or "cua_rl.cpu.rpc_worker")

    fork_workers._cua_loopback = True
    LocalScheduler.fork_workers = fork_workers


def loopback_argv(argv: list[str]) -> list[str]:
    """AReaL's worker command line with its wildcard ``--host`` replaced by loopback."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--host" and out[i + 1] in ("0.0.0.0", "::"):
            out[i + 1] = LOOPBACK
    return out
