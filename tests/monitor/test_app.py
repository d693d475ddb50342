"""The HTTP API over real loopback HTTP to a real ``python -m cua_rl.monitor serve`` process."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from .conftest import full_batch, uid


def _assert_error_shape(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code and body["error"]["message"]
    return body["error"]


@pytest.fixture
def http(shared_monitor):
    with httpx.Client(base_url=shared_monitor.base_url, timeout=30) as client:
        yield client


def test_auth_missing_and_wrong_token(http, shared_monitor):
    url = "/api/ingest/batch"
    _assert_error_shape(http.post(url, json={}), 401, "unauthorized")
    _assert_error_shape(
        http.post(url, json={}, headers={"Authorization": "Bearer nope"}), 401, "unauthorized"
    )
    _assert_error_shape(
        http.post(url, json={}, headers={"Authorization": shared_monitor.token}),
        401,
        "unauthorized",
    )
    _assert_error_shape(http.get("/api/trainings"), 401, "unauthorized")
    ok = http.post(url, json={}, headers=shared_monitor.headers())
    assert ok.status_code == 200 and ok.json() == {}


def test_oversized_body_is_413(http, shared_monitor):
    big = {
        "tasks": [
            {"task_id": uid(), "name": "x" * shared_monitor.max_body_bytes, "description": ""}
        ]
    }
    err = _assert_error_shape(
        http.post("/api/ingest/batch", json=big, headers=shared_monitor.headers()),
        413,
        "body_too_large",
    )
    assert err["details"]["limit"] == shared_monitor.max_body_bytes

    # Without a Content-Length the limit holds while streaming.
    def chunks():
        for _ in range(shared_monitor.max_body_bytes // 65536 + 2):
            yield b" " * 65536

    resp = http.post("/api/ingest/batch", content=chunks(), headers=shared_monitor.headers())
    _assert_error_shape(resp, 413, "body_too_large")


def test_bad_json_is_400(http, shared_monitor):
    for body in (b"{not json", b"", b"\xff\xfe"):
        _assert_error_shape(
            http.post("/api/ingest/batch", content=body, headers=shared_monitor.headers()),
            400,
            "bad_json",
        )


def test_validation_error_is_422_naming_record_and_field(http, shared_monitor):
    batch = full_batch()
    batch["actions"][0]["num_tokens"] = "three"
    err = _assert_error_shape(
        http.post("/api/ingest/batch", json=batch, headers=shared_monitor.headers()),
        422,
        "validation_error",
    )
    assert err["details"] == {"kind": "actions", "index": 0, "field": "num_tokens"}
    # The batch was rolled back: its training does not exist.
    names = [
        t["run_name"]
        for t in http.get("/api/trainings?limit=1000", headers=shared_monitor.headers()).json()[
            "trainings"
        ]
    ]
    assert batch["training"]["run_name"] not in names


def test_unknown_routes_and_entities_are_404(http, shared_monitor):
    h = shared_monitor.headers()
    _assert_error_shape(http.get("/api/nothing-here", headers=h), 404, "not_found")
    _assert_error_shape(http.get("/api/trainings/987654", headers=h), 404, "not_found")
    _assert_error_shape(http.get("/api/rollouts/987654", headers=h), 404, "not_found")
    _assert_error_shape(http.get("/api/steps/987654/rollouts", headers=h), 404, "not_found")
    _assert_error_shape(http.get("/api/status-history/turn/1", headers=h), 404, "not_found")
    _assert_error_shape(http.get("/api/trainings/abc", headers=h), 422, "validation_error")
    _assert_error_shape(http.get("/api/trainings?limit=0", headers=h), 422, "validation_error")
    _assert_error_shape(http.delete("/api/trainings", headers=h), 405, "method_not_allowed")


def test_ingest_and_read_endpoints(http, shared_monitor):
    h = shared_monitor.headers()
    batch = full_batch()
    resp = http.post("/api/ingest/batch", json=copy.deepcopy(batch), headers=h)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert http.post("/api/ingest/batch", json=copy.deepcopy(batch), headers=h).json() == answer

    tid = answer["training_id"]
    listed = http.get("/api/trainings", headers=h).json()["trainings"]
    assert tid in [t["id"] for t in listed]
    training = http.get(f"/api/trainings/{tid}", headers=h).json()["training"]
    assert training["run_name"] == batch["training"]["run_name"]
    step_id = answer["steps"][0]["id"]
    assert [s["id"] for s in training["steps"]] == [step_id]

    rollouts = http.get(f"/api/steps/{step_id}/rollouts", headers=h).json()["rollouts"]
    assert [r["id"] for r in rollouts] == [answer["rollouts"][0]["id"]]
    eval_id = answer["evals"][0]["id"]
    assert http.get(f"/api/evals/{eval_id}/rollouts", headers=h).json() == {"rollouts": []}

    rollout = http.get(f"/api/rollouts/{rollouts[0]['id']}", headers=h).json()["rollout"]
    assert rollout["extra"]["gbox_run_id"] == "run-abc"
    assert json.loads(rollout["turns"][0]["actions"][0]["logprobs"]) == [-0.1, -0.2, -0.3]
    assert rollout["turns"][0]["observations"][0]["screenshot_uri"] == "s1.png"
    assert rollout["validation"]["actual_result"] == "ok"
    assert rollout["environment"]["status"] == "running"

    done = {"rollouts": [{"client_id": batch["rollouts"][0]["client_id"], "status": "completed"}]}
    assert http.post("/api/ingest/batch", json=done, headers=h).status_code == 200
    history = http.get(f"/api/status-history/rollout/{rollout['id']}", headers=h).json()["history"]
    assert [(x["old_status"], x["new_status"]) for x in history] == [
        (None, "running"),
        ("running", "completed"),
    ]
