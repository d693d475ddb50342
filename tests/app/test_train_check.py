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
    # Nothing written: no monitor database, no AReaL config.yaml or name_resolve folders.
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


def test_check_reports_every_problem_at_once_and_writes_nothing(
    tmp_path, tiny_vl_model_dir, capsys
):
    """Three problems, each of which stopped --check on its own before: a missing gym id, a
    negative learning rate and a fileroot nobody can create (/proc takes no new folders, from
    root either). All three in one run, as config errors naming the key, the command line
    and the fix; exit 2; nothing written (the monitor's folder and name_resolve's are here)."""
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "kept.txt").write_text("x")
    before = _tree(tmp_path)
    rc = train.main(
        [
            "--config", str(LOCAL), "--check",
            "cluster.fileroot=/proc/cua-rl-check",
            f"cluster.name_resolve.nfs_record_root={runs / 'name_resolve'}",
            f"monitor.db_path={runs / 'monitor.db'}",
            f"actor.path={tiny_vl_model_dir}",
            "gym.gym_id=",
            "actor.optimizer.lr=-1e-6",
        ]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 2, captured
    lines = captured.err.splitlines()
    assert len(lines) == 3 and all(ln.startswith("config error: ") for ln in lines), lines
    want = {
        "gym.gym_id": "gym.gym_id=android-world",
        "actor.optimizer.lr": "actor.optimizer.lr=1e-6",
        "cluster.fileroot": "proc file system",
    }
    for (key, fix), line in zip(want.items(), sorted(lines, key=_order(want)), strict=True):
        assert line.startswith(f"config error: {key}="), line
        assert fix in line and f"(command line: {key}=" in line, line
    assert "Traceback" not in captured.err and not captured.out.strip(), captured.out
    assert _tree(tmp_path) == before
    assert not Path("/proc/cua-rl-check").exists()


def _order(keys: dict[str, str]):
    return lambda line: next(
        i for i, k in enumerate(keys) if line.startswith(f"config error: {k}=")
    )


def test_check_on_a_template_names_every_missing_key(tmp_path, capsys):
    """configs/cua.yaml as shipped leaves five keys to the operator: one run names them all."""
    rc = train.main(
        [
            "--config", str(ROOT / "configs" / "cua.yaml"), "--check",
            f"cluster.fileroot={tmp_path}",
            f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2
    named = {line.split()[2].split("=")[0] for line in err.splitlines()}
    assert named == {
        "agent.base_url", "actor.path", "gym.gym_id", "gym.base_url", "monitor.enabled"
    }, err  # fmt: skip
    assert list(tmp_path.iterdir()) == []


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


def test_check_names_each_unreachable_service(tmp_path, dead_url, tiny_vl_model_dir, capsys):
    rc = train.main(
        _argv(
            tmp_path,
            f"gym.base_url={dead_url}",
            f"agent.base_url={dead_url}",
            "endpoint.mode=direct",
            f"endpoint.base_url={dead_url}/v1",
            f"monitor.base_url={dead_url}",
            f"actor.path={tiny_vl_model_dir}",
            "+gym.timeouts.read_attempts=1",
        )
    )
    out = capsys.readouterr().out
    assert rc == 1
    failed = {line.split()[1] for line in out.splitlines() if line.startswith("FAIL")}
    assert failed == {"gym", "agent", "model", "monitor"}, out
    assert "unreachable or misconfigured: gym, agent, model, monitor" in out


def test_check_reports_a_refused_monitor_token(tmp_path, tiny_vl_model_dir, capsys):
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
                f"actor.path={tiny_vl_model_dir}",
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
