"""Outcomes as the selector reads them: from a real monitor, over HTTP."""

from __future__ import annotations

import httpx
import pytest

from cua_rl.curriculum.outcomes import MonitorOutcomes, parse_outcomes
from cua_rl.curriculum.selector import Outcome
from cua_rl.errors import MonitorError


def test_the_monitor_aggregates_a_runs_training_rollouts_per_task_and_step(monitor):
    monitor.record(
        "run-a",
        [
            {"task": "t1", "step": 1, "reward": 1.0, "success": True},
            {"task": "t1", "step": 1, "reward": 0.0, "success": False},
            {"task": "t1", "step": 2, "reward": 1.0, "success": True},
            {"task": "t2", "step": 1, "reward": -0.1, "success": False},
            # Not outcomes: an infrastructure failure, one still running, an eval rollout.
            {"task": "t2", "step": 1, "status": "failed"},
            {"task": "t2", "step": 2, "status": "running"},
            {"task": "t1", "step": 1, "source": "eval", "reward": 1.0, "success": True},
        ],
    )
    # Another run's rollouts of the same tasks are not this run's outcomes.
    monitor.record("run-b", [{"task": "t1", "step": 1, "reward": 1.0, "success": True}])

    source = MonitorOutcomes(monitor.url, "run-a")
    got = sorted(source.fetch(), key=lambda o: (o.task_id, o.version))
    source.close()
    # Step s is trained on rollouts of policy version s - 1.
    assert got == [
        Outcome("t1", 0, 2, 1.0, 1.0),
        Outcome("t1", 1, 1, 1.0, 1.0),
        Outcome("t2", 0, 1, 0.0, -0.1),
    ]


def test_a_run_not_recorded_yet_has_no_outcomes(monitor):
    assert MonitorOutcomes(monitor.url, "nobody").fetch() == []
    body = httpx.get(f"{monitor.url}/api/task-outcomes", params={"run_name": "nobody"}).json()
    assert body == {"run_name": "nobody", "training_id": None, "outcomes": []}
    resp = httpx.get(f"{monitor.url}/api/task-outcomes")
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "validation_error"


def test_a_wrong_url_or_a_failing_monitor_is_an_error_not_an_empty_answer(monitor):
    with pytest.raises(MonitorError, match="HTTP 404"):
        MonitorOutcomes(f"{monitor.url}/not-the-monitor", "run-a").fetch()

    def broken(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text="boom")

    with pytest.raises(MonitorError, match="HTTP 500"):
        MonitorOutcomes(monitor.url, "r", transport=httpx.MockTransport(broken)).fetch()

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(MonitorError, match="refused"):
        MonitorOutcomes(monitor.url, "r", transport=httpx.MockTransport(refused)).fetch()


def test_the_token_is_sent(tmp_path):
    from cua_rl.monitor.server.app import create_app
    from cua_rl.monitor.server.store import MonitorStore
    from cua_rl.serving import ThreadedServer

    store = MonitorStore(str(tmp_path / "m.db"))
    with ThreadedServer(create_app(store, token="secret")) as server:
        with pytest.raises(MonitorError, match="HTTP 401"):
            MonitorOutcomes(server.url, "r").fetch()
        assert MonitorOutcomes(server.url, "r", token="secret").fetch() == []
    store.close()


@pytest.mark.parametrize(
    "payload",
    [
        [],
        {"outcomes": "x"},
        {"outcomes": [{"task_id": "a"}]},
        {"outcomes": [{"task_id": "a", "step": 1, "n": 1, "successes": 2, "reward_sum": 0}]},
    ],
)
def test_malformed_answers_are_refused(payload):
    with pytest.raises(MonitorError):
        parse_outcomes(payload)
