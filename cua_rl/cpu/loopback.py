"""Keep a local run's servers on loopback.

AReaL 1.0.4 picks the address its servers advertise with ``areal.utils.network.gethostip()``
(the machine's first non-loopback address), and its RPC workers bind every interface: the
workers ``LocalScheduler`` creates get no ``--host`` (the RPC server's default is ``0.0.0.0``),
the ones it forks get ``--host 0.0.0.0`` (``areal/infra/scheduler/local.py``). Its RPC server
runs whatever engine call it is sent, without authentication, so a run on a laptop would take
orders from the whole LAN. torch.distributed's store (the actor's ``MASTER_PORT``, the
controller's ``tcp://localhost`` group) listens on every interface whatever host it is given.

A local run is one machine: every ``gethostip`` AReaL has imported answers 127.0.0.1, the RPC
worker binds there (``rpc_worker`` rewrites its command line), the store of a loopback master
listens on a socket bound to 127.0.0.1, and gloo stays on the loopback interface. A cluster run
does not call this.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

LOOPBACK = "127.0.0.1"
LOOPBACK_NAMES = ("localhost", "localhost.localdomain")


def loopback_ip(*_args, **_kwargs) -> str:
    return LOOPBACK


def bind_loopback() -> None:
    """Make ``gethostip`` answer loopback in AReaL's network module and every module that has
    already imported it by name (``from areal.utils.network import gethostip``); keep
    torch.distributed's stores and gloo on loopback."""
    import areal.utils.network as network

    torch_on_loopback()
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
    """AReaL's worker command line with its wildcard ``--host`` replaced by loopback, or
    ``--host 127.0.0.1`` added where it has none (the RPC server's default is ``0.0.0.0``)."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--host":
            if out[i + 1] in ("0.0.0.0", "::"):
                out[i + 1] = LOOPBACK
            return out
    if any(arg.startswith("--host=") for arg in out):
        return out
    return [*out, "--host", LOOPBACK]


def is_loopback_host(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_socket(port: int) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:``port`` (0: a free one)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def torch_on_loopback() -> None:
    """torch.distributed's store and gloo's pairs of a loopback group on 127.0.0.1 (a one-process
    group made in a test's own process included)."""
    store_on_loopback()
    if os.path.exists("/sys/class/net/lo"):
        # gloo listens on the address the machine's hostname resolves to, which may be the LAN's.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def store_on_loopback() -> None:
    """Make torch.distributed's rendezvous start a loopback master's store on 127.0.0.1.

    torch's ``TCPStore`` server binds every interface (``::`` or ``0.0.0.0``) whatever
    ``host_name`` says; the only way to choose its address is ``master_listen_fd``, a socket the
    caller has already bound. ``init_process_group``'s ``env://`` and ``tcp://`` rendezvous both
    create their store through ``torch.distributed.rendezvous._create_c10d_store``: for a master
    on a loopback host it gets such a socket, and every rank connects to 127.0.0.1 (not to
    ``localhost``, which may resolve to ``::1`` first). Other hosts are left to torch.
    """
    import importlib

    from torch.distributed import TCPStore

    # ``torch.distributed.rendezvous`` is also the name of a function: import the module itself.
    rendezvous = importlib.import_module("torch.distributed.rendezvous")

    create = rendezvous._create_c10d_store
    if getattr(create, "_cua_loopback", False):
        return

    def create_c10d_store(hostname, port, rank, world_size, timeout, use_libuv=True):
        if not is_loopback_host(str(hostname)) or rendezvous._torchelastic_use_agent_store():
            return create(hostname, port, rank, world_size, timeout, use_libuv)
        if rank != 0:
            return create(LOOPBACK, port, rank, world_size, timeout, use_libuv)
        sock = listening_socket(port)
        # The store owns the descriptor from now on; ``detach`` keeps Python from closing it.
        return TCPStore(
            host_name=LOOPBACK,
            port=sock.getsockname()[1],
            world_size=world_size,
            is_master=True,
            timeout=timeout,
            multi_tenant=True,
            master_listen_fd=sock.detach(),
            use_libuv=use_libuv,
        )

    create_c10d_store._cua_loopback = True
    rendezvous._create_c10d_store = create_c10d_store
