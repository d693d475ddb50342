"""Ingest without HTTP: round trips, idempotency, atomicity, references, unknown fields."""

from __future__ import annotations

import copy
import json

import pytest

from cua_rl.monitor.server.store import BATCH_KEYS, IngestValidationError

from .conftest import count_rows, full_batch, uid


def counts(store) -> dict[str, int]:
    return count_rows(store._reader())


def test_full_batch_round_trips_every_key(store):
    batch = full_batch()
    assert set(batch) == set(BATCH_KEYS)  # the batch holds every key of the wire format
    answer = store.ingest(copy.deepcopy(batch))
    assert isinstance(answer["training_id"], int)
    for key in BATCH_KEYS[1:]:
        assert len(answer[key]) == len(batch[key])
        assert all(isinstance(x["id"], int) and x["client_id"] for x in answer[key])

    training = store.get_training(answer["training_id"])
    assert training["run_name"] == batch["training"]["run_name"]
    assert training["lora_rank"] == 8 and training["status"] == "running"
    assert json.loads(training["config_json"]) == {"lr": 1e-5}
    assert [s["step"] for s in training["steps"]] == [1]
    assert (
        json.loads(training["steps"][0]["rollout_progress"])
        == batch["steps"][0]["rollout_progress"]
    )
    assert [e["model_path"] for e in training["evals"]] == ["m1"]
    assert [b["model_path"] for b in training["baselines"]] == ["m0"]

    rollouts = store.list_rollouts("step", training["steps"][0]["id"])
    assert [r["rollout_id"] for r in rollouts] == [batch["rollouts"][0]["rollout_id"]]
    rollout = store.get_rollout(rollouts[0]["id"])
    assert rollout["group"] == 0 and rollout["env_index"] == 1
    # Fields the schema does not name are kept, not dropped.
    assert rollout["extra"] == {"gbox_run_id": "run-abc", "trajectory_data_json": {"turns": []}}
    (turn,) = rollout["turns"]
    assert turn["model_response"] == "tap(1,2)" and turn["extra"] == {"screen_before": "s0.png"}
    (action,) = turn["actions"]
    assert json.loads(action["tool_args"]) == {"x": 1, "y": 2}
    assert json.loads(action["tokens"]) == [1, 2, 3]
    assert json.loads(action["logprobs"]) == [-0.1, -0.2, -0.3]
    (obs,) = turn["observations"]
    assert obs["screenshot_uri"] == "s1.png"
    assert obs["extra"] == {"model_specific_input_json": {"a": 1}}
    assert rollout["validation"]["success"] == 1
    assert json.loads(rollout["validation"]["details_json"]) == {"why": "matched"}
    assert rollout["environment"]["gbox_id"] == "box-1"
    assert [(p["service"], p["probes"]) for p in training["pauses"]] == [("gym", 2)]


def test_existing_client_format_with_server_ids(store):
    """The sequence existing clients send: ids from earlier answers, no client ids on actions."""
    run = uid("run-")
    tid = store.ingest({"training": {"run_name": run, "log_path": "l", "model_name": "m"}})[
        "training_id"
    ]
    answer = store.ingest(
        {
            "tasks": [{"client_id": "t-1", "task_id": "t-1", "name": "n", "description": "d"}],
            "steps": [{"client_id": f"step-{tid}-0-0", "training_id": tid, "step": 0, "batch": 0}],
        }
    )
    task_id, step_id = answer["tasks"][0]["id"], answer["steps"][0]["id"]
    rid = store.ingest(
        {
            "rollouts": [
                {
                    "client_id": "u-1",
                    "rollout_id": "u-1",
                    "source_type": "step",
                    "step_id": step_id,
                    "task_id": task_id,
                    "model_path": "m",
                }
            ]
        }
    )["rollouts"][0]["id"]
    turn_batch = {"turns": [{"client_id": "u-1:turn:0", "rollout_id": rid, "turn": 0}]}
    turn_id = store.ingest(turn_batch)["turns"][0]["id"]
    actions = {
        "actions": [
            {"turn_id": turn_id, "tool_name": "tap", "tool_args": {"x": 1}},
            {"turn_id": turn_id, "tool_name": "tap", "tool_args": {"x": 1}},
        ],
        "validations": [{"rollout_id": rid, "success": False}],
    }
    first = store.ingest(copy.deepcopy(actions))
    before = counts(store)
    second = store.ingest(copy.deepcopy(actions))  # a retry of the same batch
    assert counts(store) == before
    assert first == second
    # Two identical actions in one batch are two actions, told apart by occurrence.
    assert before["action"] == 2 and len({a["id"] for a in first["actions"]}) == 2


def test_same_batch_twice_creates_nothing_new(store):
    batch = full_batch()
    first = store.ingest(copy.deepcopy(batch))
    before = counts(store)
    second = store.ingest(copy.deepcopy(batch))
    assert counts(store) == before
    assert first == second


def test_bad_record_rolls_back_the_batch_and_names_it(store):
    batch = full_batch()
    batch["turns"].append({"rollout_client_id": batch["rollouts"][0]["rollout_id"], "turn": "two"})
    before = counts(store)
    with pytest.raises(IngestValidationError) as err:
        store.ingest(batch)
    assert (err.value.kind, err.value.index, err.value.field) == ("turns", 1, "turn")
    assert counts(store) == before  # nothing half-written


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda b: b["rollouts"][0].update(status="exploded"), ("rollouts", 0, "status")),
        (
            lambda b: b["rollouts"][0].update(eval_client_id="nope"),
            ("rollouts", 0, "eval_client_id"),
        ),
        (lambda b: b["rollouts"][0].update(source_type="eval"), ("rollouts", 0, "eval_id")),
        (
            lambda b: b["turns"][0].update(rollout_client_id="missing"),
            ("turns", 0, "rollout_client_id"),
        ),
        (lambda b: b["actions"][0].pop("turn_client_id"), ("actions", 0, "turn_id")),
        (lambda b: b["validations"][0].pop("success"), ("validations", 0, "success")),
        (lambda b: b["steps"][0].update(training_id=10**9), ("steps", 0, "training_id")),
        (lambda b: b["training"].pop("run_name"), ("training", 0, "run_name")),
        (lambda b: b["training"].update(training_id=10**9), ("training", 0, "training_id")),
        (lambda b: b["tasks"].append(7), ("tasks", 1, None)),
    ],
)
def test_refusals_name_record_and_field(store, mutate, where):
    batch = full_batch()
    mutate(batch)
    before = counts(store)
    with pytest.raises(IngestValidationError) as err:
        store.ingest(batch)
    assert (err.value.kind, err.value.index, err.value.field) == where
    assert counts(store) == before


def test_unknown_batch_key_and_non_object_refused(store):
    with pytest.raises(IngestValidationError, match="unknown batch key"):
        store.ingest({"rolloutz": []})
    with pytest.raises(IngestValidationError, match="JSON object"):
        store.ingest([1, 2])


def test_partial_update_changes_only_sent_fields_and_records_history(store):
    batch = full_batch()
    store.ingest(batch)
    uuid = batch["rollouts"][0]["rollout_id"]
    store.ingest(
        {
            "rollouts": [
                {"client_id": uuid, "status": "completed", "reward": 1.0, "extra_note": "late"}
            ]
        }
    )
    rid = store.find_id("rollout", uuid)
    rollout = store.get_rollout(rid)
    assert (rollout["status"], rollout["reward"], rollout["model_path"]) == ("completed", 1.0, "m1")
    # Extras merge: the first batch's unknown fields survive the second's.
    assert rollout["extra"]["gbox_run_id"] == "run-abc" and rollout["extra"]["extra_note"] == "late"
    assert [(h["old_status"], h["new_status"]) for h in store.status_history("rollout", rid)] == [
        (None, "running"),
        ("running", "completed"),
    ]


def test_source_type_inferred_from_the_one_id(store):
    batch = full_batch()
    del batch["rollouts"][0]["source_type"]
    store.ingest(batch)
    rid = store.find_id("rollout", batch["rollouts"][0]["rollout_id"])
    assert store.get_rollout(rid)["source_type"] == "step"


def test_string_reference_is_a_client_id(store):
    batch = full_batch()
    task_id = batch["tasks"][0]["task_id"]
    r = batch["rollouts"][0]
    del r["task_client_id"]
    r["task_id"] = task_id  # existing clients may send the task's text id
    store.ingest(batch)
    rollout = store.get_rollout(store.find_id("rollout", r["rollout_id"]))
    assert rollout["task_id"] == store.find_id("task", task_id)


def test_reads_of_missing_entities(store):
    assert store.get_training(12345) is None
    assert store.get_rollout(12345) is None
    assert store.list_rollouts("step", 12345) is None
    assert store.status_history("rollout", 12345) == []
    with pytest.raises(ValueError):
        store.status_history("turn", 1)


def test_repeated_client_id_in_one_batch_updates_the_first(store):
    batch = full_batch()
    uuid = batch["rollouts"][0]["rollout_id"]
    turn = {"client_id": f"{uuid}:turn:1", "rollout_client_id": uuid, "turn": 1}
    batch["turns"] = [dict(turn, model_response="a"), dict(turn, model_response="b")]
    answer = store.ingest(batch)
    assert answer["turns"][0] == answer["turns"][1]
    (row,) = store.get_rollout(store.find_id("rollout", uuid))["turns"]
    assert row["model_response"] == "b"
    keys = (
        store._reader()
        .execute(
            "SELECT count(*) FROM client_key WHERE entity_type = 'turn' AND client_id = ?",
            (turn["client_id"],),
        )
        .fetchone()[0]
    )
    assert keys == 1


def test_new_client_id_on_an_existing_natural_key_updates_that_row(store):
    batch = full_batch()
    store.ingest(copy.deepcopy(batch))
    uuid = batch["rollouts"][0]["rollout_id"]
    rid = store.find_id("rollout", uuid)
    # Another sender names the same turn (rollout, turn 1) with its own client id.
    answer = store.ingest(
        {"turns": [{"client_id": "other-sender-turn", "rollout_id": rid, "turn": 1, "reward": 0.5}]}
    )
    turn_id = store.find_id("turn", f"{uuid}:turn:1")
    assert answer["turns"][0]["id"] == turn_id
    assert store.find_id("turn", "other-sender-turn") == turn_id
    (row,) = store.get_rollout(rid)["turns"]
    assert (row["reward"], row["model_response"]) == (0.5, "tap(1,2)")


def _many_turns(uuid: str, n: int) -> list[dict]:
    return [
        {
            "client_id": f"{uuid}:turn:{t}",
            "rollout_client_id": uuid,
            "turn": t,
            "model_response": f"reply {t}",
            "note": f"extra {t}",
        }
        for t in range(n)
    ]


def test_answer_ids_match_the_rows_written_together(store):
    batch = full_batch()
    uuid = batch["rollouts"][0]["rollout_id"]
    batch["turns"] = _many_turns(uuid, 40)
    answer = store.ingest(batch)
    conn = store._reader()
    for sent, got in zip(batch["turns"], answer["turns"], strict=True):
        row = conn.execute("SELECT turn, model_response FROM turn WHERE id = ?", (got["id"],))
        assert tuple(row.fetchone()) == (sent["turn"], sent["model_response"])
        assert store.find_id("turn", sent["client_id"]) == got["id"]
    rollout = store.get_rollout(store.find_id("rollout", uuid))
    assert [t["extra"]["note"] for t in rollout["turns"]] == [f"extra {t}" for t in range(40)]


def test_failure_inside_a_run_of_new_records_names_that_record(store):
    batch = full_batch()
    uuid = batch["rollouts"][0]["rollout_id"]
    batch["turns"] = _many_turns(uuid, 10)
    batch["turns"][6]["rollout_id"] = 10**9  # same columns as its neighbours, a dangling reference
    del batch["turns"][6]["rollout_client_id"]
    before = counts(store)
    with pytest.raises(IngestValidationError) as err:
        store.ingest(batch)
    assert (err.value.kind, err.value.index, err.value.field) == ("turns", 6, "rollout_id")
    assert counts(store) == before


def test_natural_key_collision_inside_a_run_of_new_records(store):
    # The run of inserts hits UNIQUE(rollout_id, turn) in the database; it is redone record by
    # record, and the second sender's turn 3 updates the first one's.
    batch = full_batch()
    uuid = batch["rollouts"][0]["rollout_id"]
    batch["turns"] = _many_turns(uuid, 6)
    batch["turns"].append(dict(batch["turns"][3], client_id="other-sender", model_response="x"))
    answer = store.ingest(batch)
    assert answer["turns"][6]["id"] == answer["turns"][3]["id"]
    rollout = store.get_rollout(store.find_id("rollout", uuid))
    assert [t["turn"] for t in rollout["turns"]] == list(range(6))
    assert rollout["turns"][3]["model_response"] == "x"
    assert store.find_id("turn", "other-sender") == answer["turns"][3]["id"]
