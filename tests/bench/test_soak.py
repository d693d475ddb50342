"""The pure pieces of bench/soak.py (bench/soak_accounting.py) on hand-made inputs: the fault
schedule, which fault a rejection falls under, lost records and the verdict. The soak itself
(minutes of training under faults) is a bench, not a test."""

from __future__ import annotations

from datetime import datetime

import pytest

from cua_rl.monitor.server.read import MonitorReader
from tests.bench import load_bench, training_db


@pytest.fixture(scope="module")
def soak():
    with load_bench("soak_accounting") as module:
        yield module


def test_schedule_spaces_the_kinds_in_turn_and_ends_each_fault_in_time(soak):
    faults = soak.fault_schedule(100.0, 400.0)
    # The longest fault lasts 30 s, so one starts every 45 s: at 100, 145, ..., 370 (ends 400).
    assert [f.at_s for f in faults] == [100.0, 145.0, 190.0, 235.0, 280.0, 325.0, 370.0]
    assert [f.kind for f in faults] == [*soak.FAULT_KINDS, "gym_5xx"]
    assert len(soak.FAULT_KINDS) == 6
    assert all(f.end_s <= 400.0 for f in faults)
    assert all(a.end_s <= b.at_s for a, b in zip(faults, faults[1:], strict=False))


def test_schedule_too_short_for_a_fault_is_empty(soak):
    assert soak.fault_schedule(100.0, 120.0) == []
    assert soak.fault_schedule(100.0, 50.0) == []


def _faults(soak):
    return [soak.Fault("gym_5xx", 100.0, 20.0), soak.Fault("agent_kill", 200.0, 5.0)]


def test_a_rejection_falls_under_the_last_fault_whose_window_holds_it(soak):
    faults = _faults(soak)
    assert soak.fault_for(99.0, faults) is None  # before any fault
    assert soak.fault_for(110.0, faults) == 0
    assert soak.fault_for(180.0, faults) == 0  # 60 s after the end at 120
    assert soak.fault_for(181.0, faults) is None
    assert soak.fault_for(210.0, faults) == 1
    assert soak.fault_for(266.0, faults) is None


def test_account_counts_each_status_and_explains_rejections(soak):
    ep = soak.Episode
    episodes = [
        ep("a", "completed", "", 50.0),
        ep("b", "failed", "gym_error", 105.0),
        ep("c", "failed", "gym_error", 119.0),
        ep("d", "failed", "agent_AgentError", 206.0),
        ep("e", "failed", "gym_error", 300.0),  # under no fault
        ep("f", "failed", "", 110.0),  # no reason: unexplained even inside a fault
        ep("g", "cancelled", "cancelled", 400.0),
        ep("h", "running", "", None),
    ]
    acc = soak.account(episodes, _faults(soak))
    assert (acc.started, acc.finished, acc.cancelled, acc.open) == (8, 1, 1, 1)
    assert acc.rejected == {"gym_error": 3, "agent_AgentError": 1, "(no reason)": 1}
    assert acc.by_fault == {0: {"gym_error": 2}, 1: {"agent_AgentError": 1}}
    assert [e.rollout_id for e in acc.unexplained] == ["e", "f"]
    assert acc.explained == 3


def test_lost_records_name_the_worker_rejections_the_monitor_lacks(soak):
    worker = {"u1": "gym_error", "u2": "no_turns", "u3": "gym_error"}
    recorded = {"u1": ("failed", "gym_error"), "u2": ("running", "")}
    assert soak.lost_records(worker, recorded) == [
        "u2: rejected (no_turns) by the worker, running in the monitor",
        "u3: rejected (gym_error) by the worker, absent from the monitor",
    ]


def test_verdict_names_every_problem(soak):
    clean = soak.account([soak.Episode("a", "completed", "", 1.0)], [])
    assert soak.verdict(clean, 0, 0, 0, 0).startswith("verdict: OK")
    bad = soak.account(
        [soak.Episode("a", "failed", "gym_error", 1.0), soak.Episode("b", "running", "", None)],
        [],
    )
    line = soak.verdict(bad, 2, 3, 1, 4)
    assert line == (
        "verdict: FAIL: 1 rejections under no fault; 1 rollouts and 4 environments still open; "
        "2 gym executions alive; 3 records lost; 1 records duplicated"
    )


def test_worker_view_reads_rejections_and_surplus_episodes(soak):
    u1, u2, u3 = (f"{c * 8}-0000-0000-0000-000000000000" for c in "abc")
    lines = [
        f"... WARNING episode {u1} rejected: gym_error: create answered 500",
        f"... WARNING episode {u2} failed: agent service down",
        f"... INFO episode {u3} samples policy version 7 after the last step: not recorded",
        "... INFO something else",
    ]
    rejected, surplus = soak.worker_view(lines)
    assert rejected == {u1: "gym_error: create answered 500", u2: "agent service down"}
    assert surplus == {u3}


def test_roles_come_from_the_nearest_marked_command_line(soak):
    engine = "python -m vllm.v1.engine.core"
    server = "python -m cua_rl.inference.vllm_server --port 1"
    worker = "python -m cua_rl.cpu.rpc_worker --role rollout --port 2"
    trainer = "python -m examples.cua_agent.train --config configs/local.yaml"
    assert soak.role_of([engine, server, worker, trainer]) == "vllm"
    assert soak.role_of([worker, trainer]) == "rollout"
    assert soak.role_of(["python -m cua_rl.cpu.rpc_worker --role eval-rollout"]) == "eval-rollout"
    assert soak.role_of([trainer]) == "trainer"
    assert soak.role_of(["bash"]) is None


def test_monitor_timestamps_become_seconds_after_the_start(soak):
    t0 = datetime(2026, 11, 25, 8, 0, 0)
    assert soak.seconds_after("2026-11-25 08:01:30.500000", t0) == pytest.approx(90.5)
    assert soak.seconds_after("2026-11-25T09:01:30+01:00", t0) == pytest.approx(90.0)
    assert soak.seconds_after(None, t0) is None


def test_reader_gives_outcomes_and_counts_open_and_twice_stored_records(tmp_path):
    path = tmp_path / "monitor.db"
    db = training_db(path, "cancelled")
    db.execute("INSERT INTO step (id, training_id, step, status) VALUES (1, 1, 1, 'completed')")
    db.execute("INSERT INTO eval (id, training_id, step, model_path) VALUES (1, 1, 1, 'm')")
    rollouts = [(1, "step", "completed", None), (2, "step", "failed", "gym_error"),
                (3, "eval", "completed", None)]  # fmt: skip
    for rid, source, status, reason in rollouts:
        db.execute(
            f"INSERT INTO rollout (id, source_type, {source}_id, rollout_id, task_id, model_path,"
            " status, status_message, end_time) VALUES (?, ?, 1, ?, 1, 'm', ?, ?, ?)",
            (rid, source, f"u{rid}", status, reason, "2026-11-25 08:00:00"),
        )
    # Rollout 1: two environments (one still running, one naming a box); rollout 2: one
    # terminated environment with a box, one validation stored twice.
    for rid, status, box in ((1, "running", None), (1, "terminated", "b1"), (2, "error", "b2")):
        db.execute(
            "INSERT INTO environment (rollout_id, env_type, status, gbox_id) VALUES (?, 'a', ?, ?)",
            (rid, status, box),
        )
    db.executemany("INSERT INTO validation (rollout_id, success) VALUES (?, 0)", [(2,), (2,)])
    db.execute("INSERT INTO turn (id, rollout_id, turn) VALUES (1, 1, 1)")
    # The same action three times and two different observations on one turn.
    db.executemany(
        "INSERT INTO action (turn_id, action_type, tokens) VALUES (1, 'tap', '[1, 2]')", [()] * 3
    )
    db.executemany(
        "INSERT INTO obs (turn_id, obs_type, screenshot_uri) VALUES (1, 'shot', ?)",
        [("a",), ("b",)],
    )
    db.commit()
    db.close()
    reader = MonitorReader(path)
    try:
        keys = ("rollout_id", "status", "status_message", "end_time")
        outcomes = [tuple(r[k] for k in keys) for r in reader.training_rollout_outcomes(1)]
        integrity = reader.record_integrity()
    finally:
        reader.close()
    assert sorted(outcomes) == [
        ("u1", "completed", None, "2026-11-25 08:00:00"),
        ("u2", "failed", "gym_error", "2026-11-25 08:00:00"),
    ]
    assert integrity == {
        "open_environments": 1,
        "boxes": 2,
        "duplicate_actions": 2,
        "duplicate_observations": 0,
        "duplicate_environments": 1,
        "duplicate_validations": 1,
    }
