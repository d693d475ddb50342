"""The local agent as a service: the CLI's ready line, the thread runner, and API details."""

from __future__ import annotations

import calendar
import os
import signal
import subprocess
import sys

import httpx
import pytest

from cua_rl.errors import ConfigError
from cua_rl.sim.agent import AgentServer, AgentServerConfig, parse_time
from tests.agent.conftest import REPO


def test_cli_prints_ready_url_serves_and_stops_on_interrupt():
    proc = subprocess.Popen(
        [sys.executable, "-m", "cua_rl.sim", "agent", "--host", "127.0.0.1", "--port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline().strip()  # bounded by the pytest timeout
        assert line.startswith("ready http://127.0.0.1:"), (line, proc.stderr.read())
        url = line.split(" ", 1)[1]
        port = int(url.rsplit(":", 1)[1])
        assert port > 0
        health = httpx.get(f"{url}/healthz", timeout=5).json()
        assert health == {
            "ok": True, "runs": 0, "runs_in_memory": 0, "spilled_bytes": 0, "disk_bytes": 0,
            "spill_errors": 0,
        }  # fmt: skip
        assert httpx.get(f"{url}/runs/nope", timeout=5).status_code == 404
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_cli_rejects_bad_options_with_a_message():
    res = subprocess.run(
        [sys.executable, "-m", "cua_rl.sim", "agent", "--max-tokens", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2 and "max_tokens" in res.stderr


def test_two_thread_servers_get_their_own_ports_and_stop_cleanly():
    with AgentServer() as a, AgentServer() as b:
        assert a.port != b.port
        for server in (a, b):
            assert httpx.get(f"{server.url}/healthz", timeout=5).json()["ok"] is True
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{a.url}/healthz", timeout=2)


def test_config_validation_says_what_to_fix():
    with pytest.raises(ConfigError, match="image_mode"):
        AgentServerConfig(image_mode="file")
    with pytest.raises(ConfigError, match="http_timeout_s"):
        AgentServerConfig(http_timeout_s=0)


def test_time_bounds_accept_epoch_ms_and_iso():
    expected = calendar.timegm((2026, 1, 2, 3, 4, 5, 0, 0, 0)) * 1000 + 678
    assert parse_time("2026-01-02T03:04:05.678Z") == expected
    assert parse_time("2026-01-02T03:04:05.678+00:00") == expected
    assert parse_time(str(expected)) == expected


async def test_events_with_a_bad_time_bound_answer_400(
    agent, gym, new_execution, spec_for, closed_port_url
):
    ex = await new_execution()
    body = spec_for(ex, model_base_url=f"{closed_port_url}/v1").body()
    async with httpx.AsyncClient(base_url=agent.url, timeout=10) as http:
        run_id = (await http.post("/runs", json=body)).json()["runId"]
        resp = await http.get(f"/runs/{run_id}/events", params={"from": "yesterday"})
        assert resp.status_code == 400 and "yesterday" in resp.text
