"""The monitor's URL and token are resolved once, by the trainer, and handed on: the embedded
monitor, the trainer's client and the rollout workers' clients use that one answer, and a worker
whose environment differs does not read its own."""

from __future__ import annotations

from cua_rl.app.endpoint import MonitorEndpoint
from cua_rl.rollout.runtime import monitor_config
from tests.app.conftest import load_local

URL = "http://127.0.0.1:9"  # the discard port: nothing is sent in these tests


def _worker_client(config, endpoint: MonitorEndpoint):
    """The monitor client a rollout worker makes from the settings the trainer sends it."""
    settings = config.workflow_settings(monitor_base_url=endpoint.url, monitor_token=endpoint.token)
    return monitor_config(settings)


def test_the_environment_s_token_is_read_by_the_trainer_only(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_BASE_URL", URL)
    monkeypatch.setenv("MONITOR_PROJECT_TOKEN", "trainer-env")
    config = load_local(tmp_path, "monitor.base_url=")
    with MonitorEndpoint(config) as endpoint:
        assert (endpoint.url, endpoint.token) == (URL, "trainer-env")
        assert endpoint.client_config(tmp_path).token == "trainer-env"
        monkeypatch.setenv("MONITOR_PROJECT_TOKEN", "worker-env")  # a worker's own environment
        assert _worker_client(config, endpoint).token == "trainer-env"
    assert "trainer-env" not in str(config.monitor)  # the recorded config holds no env token


def test_no_token_is_no_token_in_the_workers_too(tmp_path, monkeypatch):
    monkeypatch.delenv("MONITOR_PROJECT_TOKEN", raising=False)
    config = load_local(tmp_path, f"monitor.base_url={URL}")
    with MonitorEndpoint(config) as endpoint:
        monkeypatch.setenv("MONITOR_PROJECT_TOKEN", "worker-env")
        assert endpoint.token == "" and _worker_client(config, endpoint).token == ""


def test_the_config_s_token_wins_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_PROJECT_TOKEN", "env")
    config = load_local(tmp_path, f"monitor.base_url={URL}", "monitor.token=cfg")
    with MonitorEndpoint(config) as endpoint:
        assert endpoint.token == "cfg" and _worker_client(config, endpoint).token == "cfg"
