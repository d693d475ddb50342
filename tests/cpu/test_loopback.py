"""A local run's AReaL workers bind and advertise loopback, not the machine's LAN address."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cua_rl.cpu.loopback import bind_loopback, fork_our_worker, loopback_argv


def test_the_worker_command_line_binds_loopback_instead_of_every_interface():
    argv = ["rpc_worker", "--port", "4000", "--host", "0.0.0.0", "--role", "actor"]
    assert loopback_argv(argv) == [
        "rpc_worker", "--port", "4000", "--host", "127.0.0.1", "--role", "actor"
    ]  # fmt: skip
    assert loopback_argv(["x", "--host", "::"]) == ["x", "--host", "127.0.0.1"]
    # A host the config chose is left alone.
    assert loopback_argv(["x", "--host", "10.1.2.3"]) == ["x", "--host", "10.1.2.3"]
    assert loopback_argv(["x", "--host=10.1.2.3"]) == ["x", "--host=10.1.2.3"]
    # LocalScheduler's first workers get no --host: the RPC server would take its default,
    # 0.0.0.0.
    assert loopback_argv(["rpc_worker", "--port", "4000"]) == [
        "rpc_worker", "--port", "4000", "--host", "127.0.0.1"
    ]  # fmt: skip


# A process group as AReaL's controller (tcp://localhost) and FSDP actor (env://, MASTER_ADDR)
# make them, then the inet sockets of the process, read from the kernel. Only the patched runs
# import AReaL (bind_loopback patches its modules): its import is 14 of a run's 17 CPU s.
GROUP = """
import os, sys
if sys.argv[1] == "patched":
    from cua_rl.cpu.loopback import bind_loopback
    bind_loopback()
elif sys.argv[1] == "actor":  # the one-process group the tests' in-process actor makes
    from cua_rl.testing.actor import init_single_process_group
    init_single_process_group()
import torch.distributed as dist
from cua_rl.testing.sockets import listening, tree_sockets
from cua_rl.testing.vllm_server import free_port
port = free_port()
if sys.argv[2] == "tcp":
    dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=0, world_size=1)
else:
    if sys.argv[1] != "actor":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
dist.barrier(group=dist.new_group(backend="gloo"))
for e in listening(tree_sockets(os.getpid())):
    print("LISTEN", e.local)
"""


def _group_listeners(mode: str, rendezvous: str) -> list[str]:
    run = subprocess.run(
        [sys.executable, "-c", GROUP, mode, rendezvous], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [line.split()[1] for line in run.stdout.splitlines() if line.startswith("LISTEN ")]


@pytest.mark.slow
def test_torch_distributed_stores_of_a_local_run_listen_on_loopback_only():
    from cua_rl.testing.sockets import is_loopback

    for rendezvous in ("tcp", "env"):
        # Unpatched, torch's store listens on every interface (the test can see a wildcard).
        plain = _group_listeners("plain", rendezvous)
        assert any(not is_loopback(a.rsplit(":", 1)[0]) for a in plain), plain
        patched = _group_listeners("patched", rendezvous)
        assert patched and all(is_loopback(a.rsplit(":", 1)[0]) for a in patched), patched
    # The group a test's in-process actor makes (the pytest process's own listeners).
    actor = _group_listeners("actor", "env")
    assert actor and all(is_loopback(a.rsplit(":", 1)[0]) for a in actor), actor


def test_areal_modules_that_imported_gethostip_answer_loopback(monkeypatch):
    import importlib

    import areal.infra.scheduler.local as local
    import areal.utils.network as network

    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    # Undone at the end: bind_loopback also patches torch and sets gloo's interface.
    monkeypatch.setattr(rendezvous, "_create_c10d_store", rendezvous._create_c10d_store)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    original = network.gethostip
    try:
        bind_loopback()
        assert local.gethostip() == "127.0.0.1"
        assert network.gethostip() == "127.0.0.1"
    finally:
        network.gethostip = original
        local.gethostip = original


def test_forked_workers_run_the_harness_worker_unless_a_command_is_given():
    from areal.infra.scheduler.local import LocalScheduler

    original = LocalScheduler.fork_workers
    calls = []
    LocalScheduler.fork_workers = lambda self, role, target_role, command=None: calls.append(
        command
    )
    try:
        fork_our_worker()
        LocalScheduler.fork_workers(None, "eval-rollout", "rollout")
        LocalScheduler.fork_workers(None, "proxy", "rollout", command="some.module")
    finally:
        LocalScheduler.fork_workers = original
    assert calls == ["cua_rl.cpu.rpc_worker", "some.module"]


def test_the_socket_reader_tells_loopback_from_every_interface():
    import os
    import socket

    from cua_rl.testing.sockets import Endpoint, is_loopback, listening, off_loopback, tree_sockets

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.2")
    # A listener and a connection of this process, read from the kernel (loopback only: the
    # test opens nothing on another interface).
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client.connect(server.getsockname())
        # This test's sockets only: in the suite the process also holds what other tests opened.
        address = f"127.0.0.1:{server.getsockname()[1]}"
        ours = [
            e
            for e in tree_sockets(os.getpid())
            if e.pid == os.getpid() and address in (e.local, e.remote)
        ]
    assert address in {e.local for e in listening(ours)}
    assert address in {e.remote for e in ours if e.status == "ESTABLISHED"}
    assert off_loopback(ours) == []
    # What the kernel reports for a wildcard listener and an outward connection.
    wide = Endpoint(1, "x", "LISTEN", ":::4000", "")
    udp = Endpoint(1, "x", "NONE", "0.0.0.0:5353", "")
    out = Endpoint(1, "x", "ESTABLISHED", "127.0.0.1:5000", "10.0.0.2:443")
    back = Endpoint(1, "x", "ESTABLISHED", "::ffff:127.0.0.1:5000", "::ffff:127.0.0.1:6000")
    assert off_loopback([wide, udp, out, back]) == [wide, udp, out]
