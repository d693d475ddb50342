"""``train --check``: each service is reached for real and each unreachable one is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from cua_rl.app import train
from cua_rl.serving import bind_free_port
from cua_rl.sim.agent import AgentServer
from cua_rl.sim.gym import GymServer

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "configs" / "local.yaml"


@pytest.fixture
def dead_url():
    # A bound but never-listening socket: connections are refused for the test's duration.
    sock = bind_free_port()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _argv(tmp_path, *overrides):
    return ["--config", str(LOCAL), "--check", f"cluster.fileroot={tmp_path}", *overrides]


def test_check_reaches_every_service(tmp_path, tiny_vl_model_dir, capsys):
    with GymServer() as gym, AgentServer() as agent:
        rc = train.main(
            _argv(
                tmp_path,
                f"gym.base_url={gym.url}",
                f"agent.base_url={agent.url}",
                f"actor.path={tiny_vl_model_dir}",
                f"monitor.db_path={tmp_path / 'monitor.db'}",
            )
        )
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("gym", "agent", "gateway", "model", "monitor"):
        assert any(line.startswith("ok") and f" {name} " in line for line in out.splitlines()), out
    assert (tmp_path / "monitor.db").exists()


def test_check_in_builtin_mode_needs_no_agent_service(tmp_path, tiny_vl_model_dir, capsys):
    with GymServer() as gym:
        rc = train.main(
            _argv(
                tmp_path,
                f"gym.base_url={gym.url}",
                "agent.mode=builtin",
                "agent.base_url=",
                f"actor.path={tiny_vl_model_dir}",
                f"monitor.db_path={tmp_path / 'monitor.db'}",
            )
        )
    out = capsys.readouterr().out
    assert rc == 0, out
    (agent,) = [line for line in out.splitlines() if line.split()[1:2] == ["agent"]]
    assert agent.startswith("ok") and "builtin" in agent, out


def test_check_names_each_unreachable_service(tmp_path, dead_url, capsys):
    rc = train.main(
        _argv(
            tmp_path,
            f"gym.base_url={dead_url}",
            f"agent.base_url={dead_url}",
            "endpoint.mode=direct",
            f"endpoint.base_url={dead_url}/v1",
            f"monitor.base_url={dead_url}",
            "actor.path=/models/tiny",
            "+gym.timeouts.read_attempts=1",
        )
    )
    out = capsys.readouterr().out
    assert rc == 1
    failed = {line.split()[1] for line in out.splitlines() if line.startswith("FAIL")}
    assert failed == {"gym", "agent", "model", "monitor"}, out
    assert "unreachable or misconfigured: gym, agent, model, monitor" in out


def test_check_reports_a_refused_monitor_token(tmp_path, capsys):
    from cua_rl.monitor.server.app import create_app
    from cua_rl.monitor.server.store import MonitorStore
    from cua_rl.serving import ThreadedServer

    store = MonitorStore(str(tmp_path / "m.db"))
    with (
        GymServer() as gym,
        AgentServer() as agent,
        ThreadedServer(create_app(store, token="right")) as mon,
    ):
        rc = train.main(
            _argv(
                tmp_path,
                f"gym.base_url={gym.url}",
                f"agent.base_url={agent.url}",
                f"monitor.base_url={mon.url}",
                "monitor.token=wrong",
                "actor.path=/models/tiny",
            )
        )
    store.close()
    out = capsys.readouterr().out
    assert rc == 1
    assert any(line.startswith("FAIL") and "token refused" in line for line in out.splitlines())


def test_check_refuses_a_loopback_gateway_for_a_remote_agent(tmp_path, capsys):
    from cua_rl.app.check import gateway_check
    from cua_rl.app.train import load_config

    config = load_config(
        [
            "--config", "configs/local.yaml", f"cluster.fileroot={tmp_path}",
            "actor.path=/models/tiny", "agent.base_url=http://agent.internal:3000",
        ]
    )  # fmt: skip
    result = gateway_check(config)
    assert not result.ok and "gateway.bind_host=0.0.0.0" in result.detail
    config.gateway.bind_host = "0.0.0.0"
    assert gateway_check(config).ok
