"""The existing Training Monitor client's dialect (docs/monitor.md, Compatibility).

The bodies that client posted for one small training (data/legacy_client_bodies.json; data/
README.md says how they were recorded) are replayed in order over real loopback HTTP to a real
``python -m cua_rl.monitor serve`` with a temp SQLite file, each id the client had been answered
replaced by the id our monitor answered. Expected figures come from the issue's account of that
training (1 step, 2 rollouts of 2 turns, ...) and from the bodies themselves, never from the
code under test.
"""

from __future__ import annotations

import copy
import json
import sqlite3
from pathlib import Path

import httpx
import pytest

from cua_rl.monitor.server.migrations import connect, migrate
from cua_rl.monitor.server.schema import MIGRATIONS
from cua_rl.monitor.server.store import IngestValidationError, MonitorStore

from .conftest import COUNTED, count_rows, full_batch, uid

BODIES = Path(__file__).parent / "data" / "legacy_client_bodies.json"

# Fields of the dialect that hold an id the server answered earlier, and the answer key it
# came from. A text value (a rollout's uuid ``rollout_id``, a task's ``task_id``) is no id.
ID_FIELDS = {
    "training_id": "training",
    "step_id": "steps",
    "eval_id": "evals",
    "baseline_id": "baselines",
    "env_id": "environments",
    "task_id": "tasks",
    "rollout_id": "rollouts",
    "turn_id": "turns",
    "validator_id": "validators",
}

# A replay re-plays status transitions, which history records again; nothing else may grow.
ENTITY_TABLES = tuple(t for t in COUNTED if t != "status_history")


def recorded() -> list[dict]:
    return json.loads(BODIES.read_text())


def _substitute(record: dict, ids: dict[str, dict[int, int]]) -> dict:
    out = dict(record)
    for name, kind in ID_FIELDS.items():
        value = out.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            assert value in ids.get(kind, {}), f"{name}={value} was never answered before"
            out[name] = ids[kind][value]
    return out


def replay(http: httpx.Client, headers: dict) -> list[dict]:
    """Post every recorded body in order; returns our monitor's answers."""
    ids: dict[str, dict[int, int]] = {}
    answers = []
    for n, post in enumerate(recorded()):
        body = {
            key: _substitute(value, ids)
            if key == "training"
            else [_substitute(r, ids) for r in value]
            for key, value in copy.deepcopy(post["body"]).items()
        }
        resp = http.post("/api/ingest/batch", json=body, headers=headers)
        assert resp.status_code == 200, f"post {n} refused: {resp.text}"
        answer, theirs = resp.json(), post["stand_in_answer"]
        for key, mapped in theirs.items():
            if key == "training_id":
                ids.setdefault("training", {})[mapped] = answer["training_id"]
                continue
            assert len(answer[key]) == len(mapped)
            for mine, stand_in in zip(answer[key], mapped, strict=True):
                if stand_in["client_id"] is not None:  # the client maps answers by client id
                    assert mine["client_id"] == stand_in["client_id"]
                assert isinstance(mine["id"], int)
                ids.setdefault(key, {})[stand_in["id"]] = mine["id"]
        answers.append(answer)
    return answers


def counts(db: Path) -> dict[str, int]:
    conn = sqlite3.connect(db)
    try:
        return count_rows(conn, ENTITY_TABLES)
    finally:
        conn.close()


@pytest.fixture
def http(monitor_process):
    with httpx.Client(base_url=monitor_process.base_url, timeout=30) as client:
        yield client


def _get(http, headers, path) -> dict:
    resp = http.get(path, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _history(http, headers, kind, entity_id) -> list[tuple]:
    rows = _get(http, headers, f"/api/status-history/{kind}/{entity_id}")["history"]
    return [
        (h["old_status"], h["new_status"], json.loads(h["metadata_json"] or "null")) for h in rows
    ]


def test_recorded_training_is_accepted_and_recorded_faithfully(http, monitor_process):
    headers = monitor_process.headers()
    posts = recorded()
    answers = replay(http, headers)
    assert len(answers) == len(posts) == 43

    training_id = answers[0]["training_id"]
    assert answers[-1]["training_id"] == training_id  # the update by id hit the same training
    training = _get(http, headers, f"/api/trainings/{training_id}")["training"]
    sent = posts[0]["body"]["training"]
    assert training["run_name"] == sent["run_name"]
    assert training["status"] == "completed"
    assert training["current_phase"] == sent["current_phase"]
    # Not sent: the documented defaults. Sent but not in the schema: kept.
    assert (training["log_path"], training["model_name"]) == ("", "")
    assert training["extra"] == {
        "experiment_name": sent["experiment_name"],
        "trial_name": sent["trial_name"],
    }
    assert _history(http, headers, "training", training_id) == [
        (None, "running", None),
        ("running", "completed", None),
    ]

    (step,) = training["steps"]
    (baseline,) = training["baselines"]
    (ev,) = training["evals"]
    assert step["step"] == 0 and step["status"] == "rollout_running"
    assert step["extra"] == {"client_status": "running"}
    assert _history(http, headers, "step", step["id"]) == [
        (None, "rollout_running", {"client_status": "running"})
    ]
    assert (baseline["status"], ev["status"], ev["step"]) == ("running", "running", 1)

    rollouts = _get(http, headers, f"/api/steps/{step['id']}/rollouts")["rollouts"]
    assert len(rollouts) == 2
    sent_rollouts = [p["body"]["rollouts"][0] for p in posts if "is_eval" in str(p["body"])]
    assert [r["rollout_id"] for r in rollouts] == [s["rollout_id"] for s in sent_rollouts]
    turns = actions = observations = 0
    for r, first in zip(rollouts, sent_rollouts, strict=True):
        assert r["status"] == "completed" and r["step_id"] == step["id"]
        assert (r["group"], r["env_index"]) == (first["group_num"], first["env_index"])
        assert r["extra"]["gbox_run_id"] == f"run-{first['env_index']}"
        full = _get(http, headers, f"/api/rollouts/{r['id']}")["rollout"]
        assert [t["turn"] for t in full["turns"]] == [1, 2]
        for t in full["turns"]:
            assert t["extra"]["screen_before"].endswith(f"/{t['turn']}.png")
            assert json.loads(t["metrics_json"])["stage_timings"]
            (action,) = t["actions"]
            assert (
                action["tool_name"]
                == action["action_type"]
                == action["extra"]["action_json"]["name"]
            )
            assert json.loads(action["tool_args"]) == action["extra"]["action_json"]["args"]
            assert len(t["observations"]) == 1
            actions += len(t["actions"])
            observations += len(t["observations"])
        turns += len(full["turns"])
        assert full["validation"]["success"] == r["task_success"]
        (env,) = full["environments"]
        assert env["status"] == "terminated" and env["rollout_id"] == r["id"]
        assert env["gbox_id"] == f"run-{first['env_index']}"
        assert "client_status" not in (env.get("extra") or {})  # a seed word came later
        assert _history(http, headers, "environment", env["id"]) == [
            (None, "creating", {"client_status": "created"}),
            ("creating", "running", None),
            ("running", "terminated", None),
        ]
        assert _history(http, headers, "rollout", r["id"]) == [
            (None, "running", None),
            ("running", "completed", None),
        ]
    assert (turns, actions, observations) == (4, 4, 4)
    assert [r["reward"] for r in rollouts] == [1.0, 0.0]

    found = counts(monitor_process.db)
    expected = {
        "training": 1,
        "task": 1,  # both samples are the same task
        "step": 1,
        "baseline": 1,
        "eval": 1,
        "rollout": 2,
        "environment": 2,
        "turn": 4,
        "action": 4,
        "obs": 4,
        "validation": 2,
    }
    assert {k: found[k] for k in expected} == expected


def test_replaying_the_training_twice_duplicates_nothing(http, monitor_process):
    headers = monitor_process.headers()
    first = replay(http, headers)
    before = counts(monitor_process.db)
    second = replay(http, headers)
    assert counts(monitor_process.db) == before
    assert second == first  # every record mapped to the same row again


def test_seed_form_batch_still_round_trips_over_http(http, monitor_process):
    headers = monitor_process.headers()
    batch = full_batch()
    answer = http.post("/api/ingest/batch", json=batch, headers=headers).json()
    rollout = _get(http, headers, f"/api/rollouts/{answer['rollouts'][0]['id']}")["rollout"]
    assert rollout["extra"] == {"gbox_run_id": "run-abc", "trajectory_data_json": {"turns": []}}
    env = rollout["environment"]
    assert env["id"] == answer["environments"][0]["id"] and env["status"] == "running"
    assert "extra" not in env  # no dialect note on a seed-form record


# ---------------------------------------------------------------- what is still refused


def _legacy_start(store: MonitorStore) -> dict:
    """A training, task, step and one environment posted the way the existing client does."""
    tid = store.ingest({"training": {"run_name": uid("run-"), "status": "running"}})["training_id"]
    task = store.ingest(
        {"tasks": [{"client_id": "t", "task_id": "t", "name": "n", "description": ""}]}
    )
    step = store.ingest(
        {
            "steps": [
                {"client_id": f"step-{tid}-0-0", "training_id": tid, "step": 0, "status": "running"}
            ]
        }
    )
    u = uid("u-")
    env = store.ingest(
        {"environments": [{"client_id": f"{u}:env", "env_type": "genv", "status": "created"}]}
    )
    return {
        "training": tid,
        "task": task["tasks"][0]["id"],
        "step": step["steps"][0]["id"],
        "env": env["environments"][0]["id"],
        "uuid": u,
    }


def _rollout(ids: dict, **overrides) -> dict:
    return {
        "client_id": ids["uuid"],
        "rollout_id": ids["uuid"],
        "source_type": "step",
        "step_id": ids["step"],
        "eval_id": None,
        "baseline_id": None,
        "env_id": ids["env"],
        "task_id": ids["task"],
        "model_path": "m",
        "status": "running",
        **overrides,
    }


@pytest.mark.parametrize(
    ("batch", "where"),
    [
        ({"training": {"status": "running"}}, ("training", 0, "run_name")),
        (
            {"training": {"status": "completed", "training_id": 10**9}},
            ("training", 0, "training_id"),
        ),
        ({"training": {"training_id": True}}, ("training", 0, "training_id")),
        ({"training": {"run_name": "r", "status": "created"}}, ("training", 0, "status")),
    ],
)
def test_truly_invalid_trainings_are_refused(store, batch, where):
    with pytest.raises(IngestValidationError) as err:
        store.ingest(batch)
    assert (err.value.kind, err.value.index, err.value.field) == where


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"env_id": 10**9}, "env_id"),  # no such environment
        ({"env_id": None, "env_client_id": "nope:env"}, "env_client_id"),
        ({"step_id": None}, "step_id"),  # the source rule holds
        ({"status": "created"}, "status"),  # a word mapped for environments, not rollouts
        ({"task_id": 10**9}, "task_id"),
    ],
)
def test_truly_invalid_rollouts_are_refused(store, overrides, field):
    ids = _legacy_start(store)
    with pytest.raises(IngestValidationError) as err:
        store.ingest({"rollouts": [_rollout(ids, **overrides)]})
    assert (err.value.kind, err.value.field) == ("rollouts", field)
    conn = store._reader()
    assert (
        conn.execute("SELECT rollout_id FROM environment WHERE id = ?", (ids["env"],)).fetchone()[0]
        is None
    )


def test_an_environment_belongs_to_one_rollout(store):
    ids = _legacy_start(store)
    store.ingest({"rollouts": [_rollout(ids)]})
    other = uid("u-")
    with pytest.raises(IngestValidationError) as err:
        store.ingest({"rollouts": [_rollout(ids, client_id=other, rollout_id=other)]})
    assert err.value.field == "env_id" and "belongs to rollout" in str(err.value)
    # The same rollout naming it again (every update of the existing client does) is fine.
    store.ingest({"rollouts": [_rollout(ids, status="completed")]})
    rollout = store.get_rollout(store.find_id("rollout", ids["uuid"]))
    assert [e["id"] for e in rollout["environments"]] == [ids["env"]]


def test_refusal_over_http_names_the_field(http, monitor_process):
    resp = http.post(
        "/api/ingest/batch",
        json={"steps": [{"training_id": 10**9, "step": 0, "status": "running"}]},
        headers=monitor_process.headers(),
    )
    assert resp.status_code == 422
    assert resp.json()["error"]["details"] == {"kind": "steps", "index": 0, "field": "training_id"}
    resp = http.post(
        "/api/ingest/batch",
        json={"environments": [{"env_type": "genv", "status": "destroyed"}]},
        headers=monitor_process.headers(),
    )
    assert resp.status_code == 422
    assert resp.json()["error"]["details"]["field"] == "status"


# ---------------------------------------------------------------- the dialect's details


def test_mapped_word_is_kept_until_a_seed_word_replaces_it(store):
    ids = _legacy_start(store)
    conn = store._reader()

    def env_extra():
        row = conn.execute(
            "SELECT fields_json FROM extra_field WHERE entity_type = 'environment' AND entity_id = ?",
            (ids["env"],),
        ).fetchone()
        return json.loads(row[0]) if row else None

    assert env_extra() == {"client_status": "created"}
    # The same word again: no transition, the kept word stays.
    store.ingest({"environments": [{"client_id": f"{ids['uuid']}:env", "status": "created"}]})
    assert env_extra() == {"client_status": "created"}
    store.ingest(
        {"environments": [{"client_id": f"{ids['uuid']}:env", "status": "running", "note": 1}]}
    )
    assert env_extra() == {"note": 1}
    history = store.status_history("environment", ids["env"])
    assert [(h["new_status"], h["metadata_json"]) for h in history] == [
        ("creating", '{"client_status": "created"}'),
        ("running", None),
    ]


def test_training_defaults_apply_only_on_create(store):
    run = uid("run-")
    tid = store.ingest({"training": {"run_name": run}})["training_id"]
    store.ingest({"training": {"training_id": tid, "log_path": "runs/x", "model_name": "tiny"}})
    store.ingest({"training": {"training_id": tid, "status": "completed"}})
    training = store.get_training(tid)
    assert (training["log_path"], training["model_name"], training["status"]) == (
        "runs/x",
        "tiny",
        "completed",
    )
    # The seed form still works alongside: the same run by name.
    again = store.ingest({"training": {"run_name": run, "log_path": "l", "model_name": "m"}})
    assert again["training_id"] == tid and again["training"]["client_id"] == run


def test_aliases_yield_to_the_seed_fields(store):
    ids = _legacy_start(store)
    answer = store.ingest({"rollouts": [_rollout(ids, group_num=3, group=4)]})
    rollout = store.get_rollout(answer["rollouts"][0]["id"])
    assert rollout["group"] == 4 and rollout["extra"] == {"group_num": 3}
    turn = store.ingest({"turns": [{"rollout_id": rollout["id"], "turn": 1}]})["turns"][0]["id"]
    store.ingest(
        {
            "actions": [
                {
                    "turn_id": turn,
                    "action_name": "tap",
                    "action_args": {"x": 1},
                    "tool_name": "click",
                }
            ]
        }
    )
    (action,) = store.get_rollout(rollout["id"])["turns"][0]["actions"]
    assert action["tool_name"] == "click" and json.loads(action["tool_args"]) == {"x": 1}
    assert action["extra"] == {"action_name": "tap"}


# ---------------------------------------------------------------- migration 3 on an old file


def test_migration_3_keeps_an_existing_database(tmp_path):
    path = tmp_path / "v2.db"
    conn = connect(path)
    migrate(conn, MIGRATIONS[:2])
    conn.execute("INSERT INTO training (run_name, log_path, model_name) VALUES ('r', 'l', 'm')")
    conn.execute("INSERT INTO task (task_id, name, description) VALUES ('t', 'n', 'd')")
    conn.execute("INSERT INTO step (training_id, step) VALUES (1, 1)")
    conn.execute(
        "INSERT INTO rollout (source_type, step_id, rollout_id, task_id, model_path) "
        "VALUES ('step', 1, 'u', 1, 'm')"
    )
    for status in ("creating", "running", "running"):
        conn.execute(
            "INSERT INTO environment (rollout_id, env_type, status) VALUES (1, 'android', ?)",
            (status,),
        )
    conn.execute("DELETE FROM environment WHERE id = 3")  # the counter is ahead of the rows
    conn.execute("INSERT INTO client_key VALUES ('environment', 'u:env', 1)")
    history_before = conn.execute("SELECT count(*) FROM status_history").fetchone()[0]
    conn.close()

    store = MonitorStore(path)  # opening applies migration 3 (and the later ones)
    try:
        conn = store._reader()
        assert [tuple(r) for r in conn.execute("SELECT version FROM schema_migrations")] == [
            (1,),
            (2,),
            (3,),
            (4,),
            (5,),
            (6,),
            (7,),
        ]
        rows = conn.execute("SELECT id, rollout_id, status FROM environment ORDER BY id").fetchall()
        assert [tuple(r) for r in rows] == [(1, 1, "creating"), (2, 1, "running")]
        assert conn.execute("SELECT count(*) FROM status_history").fetchone()[0] == history_before
        # The table works as before: history, references by client id, and ids never reused.
        answer = store.ingest(
            {"environments": [{"client_id": "u:env", "status": "running"}, {"env_type": "genv"}]}
        )
        assert [e["id"] for e in answer["environments"]] == [1, 4]
        assert [h["new_status"] for h in store.status_history("environment", 1)] == [
            "creating",
            "running",
        ]
        with pytest.raises(IngestValidationError):
            store.ingest({"environments": [{"env_type": "genv", "rollout_id": 99}]})
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        store.close()
