"""A local run's AReaL workers bind and advertise loopback, not the machine's LAN address."""

from __future__ import annotations

from cua_rl.cpu.loopback import bind_loopback, fork_our_worker, loopback_argv


def test_the_worker_command_line_binds_loopback_instead_of_every_interface():
    argv = ["rpc_worker", "--port", "4000", "--host", "0.0.0.0", "--role", "actor"]
    assert loopback_argv(argv) == [
        "rpc_worker", "--port", "4000", "--host", "127.0.0.1", "--role", "actor"
    ]  # fmt: skip
    assert loopback_argv(["x", "--host", "::"]) == ["x", "--host", "127.0.0.1"]
    # A host the config chose is left alone.
    assert loopback_argv(["x", "--host", "10.1.2.3"]) == ["x", "--host", "10.1.2.3"]


def test_areal_modules_that_imported_gethostip_answer_loopback():
    import areal.infra.scheduler.local as local
    import areal.utils.network as network

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
