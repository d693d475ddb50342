"""Bring your own agent: Python agents of one's own train through the gateway, unchanged.

One whole training, shared by the tests here (``function_training``: the shared training
``FUNCTION_AGENTS`` of tests/conftest.py):
``make demo``'s launcher with ``--agent-mode function`` and an agent function that hands each task
to the example's agent written with the official ``openai`` SDK
(examples/cua_agent/openai_agent.py) or to an agent written with LangChain's OpenAI chat model
(tests/agent/langchain_agent.py: even task numbers), each called as it is. Three asynchronous PPO
steps (one step of staleness) through the rollout gateway, with the BPE tiny model, every episode
stored. Expected values come from the run's own records of what was sampled: the tokens the
monitor recorded for each turn's action (the gateway's capture of each call), the stored
episodes' rows (what the workflow gave AReaL), the step stats AReaL logged and the trainer's
transformers forward (``behave_approx_kl``); never from the row builder alone. Costs one
training, on the session's borrowed vLLM server (tests/README.md has its cost).
"""

from __future__ import annotations

import json
import re
import sqlite3

import pytest

from cua_rl.monitor.server import episodes
from cua_rl.warehouse import episode_from_json
from tests.conftest import db_rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1600)]

EXAMPLE, LANGCHAIN = "examples.cua_agent.openai_agent", "tests.agent.langchain_agent"
TOL = 1e-3


@pytest.fixture(scope="module")
def run(function_training):
    assert function_training.returncode == 0, function_training.output[-6000:]
    return function_training


def _completed_rollouts(db) -> list[tuple[int, str]]:
    return db_rows(
        db,
        "SELECT r.id, t.task_id FROM rollout r JOIN task t ON r.task_id = t.id "
        "WHERE r.source_type = 'step' AND r.status = 'completed' ORDER BY r.id",
    )


def _agents_by_task(run) -> dict[str, set[str]]:
    """Which agent the rollout workers called for which task (the dispatcher's log lines)."""
    seen: dict[str, set[str]] = {}
    for log in run.run_dir.rglob("*.log"):
        for module, task in re.findall(
            r"\[example_or_langchain\] (\S+) on (\S+)", log.read_text(errors="replace")
        ):
            seen.setdefault(task, set()).add(module)
    return seen


def test_both_agents_train_three_asynchronous_steps_without_losing_an_episode(run):
    assert "[demo] agent    tests.agent.langchain_agent:example_or_langchain: called" in run.output
    # No agent service was started: the rollout workers called the function.
    assert "agent.log" not in {p.name for p in (run.run_dir / "logs").iterdir()}
    steps = db_rows(run.db, "SELECT step, status, metrics_json FROM step ORDER BY step")
    assert [(n, st) for n, st, _ in steps] == [(n, "completed") for n in (1, 2, 3)]
    stats = [json.loads(m or "{}") for _, _, m in steps]
    rows = [m for m in stats if "rollout/cua/sampled_tokens" in m]
    assert rows, stats
    for m in rows:
        assert m.get("rollout/accepted", 1.0) == 1.0, m
        assert not {k: v for k, v in m.items() if "/rejected/" in k and v}, m
        # Means per episode: every sampled token trained, every call a trained turn.
        assert m["rollout/cua/trained_tokens"] == pytest.approx(m["rollout/cua/sampled_tokens"])
        assert m["rollout/cua/trained_turns"] == pytest.approx(m["rollout/cua/turns"])
        assert m["rollout/cua/gateway/calls"] == pytest.approx(m["rollout/cua/turns"])
        assert m["rollout/cua/dropped_turns"] == 0.0
    # Asynchronous: the turns were sampled by several policy versions, and a step trained samples
    # of an older version than the one it updated. With one step of staleness at most eight
    # episodes start before the first update, and twelve were trained: four or more were started
    # by version 1 or later. Which later versions reached the monitor (version 3, the weights
    # after the last update, included) is the machine's timing.
    versions = {
        v
        for (mj,) in db_rows(run.db, "SELECT metrics_json FROM turn")
        for v in json.loads(mj or "{}").get("versions", [])
    }
    assert 0 in versions and max(versions) >= 1 and versions <= {0, 1, 2, 3}, versions
    stale = [m.get("ppo_actor/update/version_stats/sample_staleness_theta_max", 0) for m in stats]
    assert max(stale) >= 1, stale
    # Step 1's tokens were sampled by version 0, the weights the trainer held: its transformers
    # forward reproduces the gateway's logprob of every trained token.
    for stat in ("min", "max"):
        assert abs(stats[0][f"ppo_actor/update/behave_approx_kl/{stat}"]) < TOL, stats[0]


def test_the_example_and_the_langchain_agent_each_ran_and_trained_their_tasks(run):
    ran = _agents_by_task(run)
    completed = _completed_rollouts(run.db)
    tasks = {task for _, task in completed}
    # Every trained task was run by one agent, the one its number picks; both agents trained.
    assert all(len(ran.get(task, ())) == 1 for task in tasks), ran
    by_agent = {next(iter(ran[task])) for task in tasks}
    assert by_agent == {EXAMPLE, LANGCHAIN}, ran
    for task in tasks:
        even = int(re.search(r"\d+", task).group()) % 2 == 0
        assert ran[task] == {LANGCHAIN if even else EXAMPLE}, (task, ran)
    for agent in (EXAMPLE, LANGCHAIN):
        mine = [rid for rid, task in completed if ran[task] == {agent}]
        turns = db_rows(
            run.db,
            f"SELECT metrics_json FROM turn WHERE rollout_id IN ({','.join('?' * len(mine))})",
            *mine,
        )
        assert turns and all(json.loads(m)["trained"] is True for (m,) in turns), agent


def test_every_sampled_token_of_every_call_is_trained(run):
    """Per stored episode: the tokens its rows train (loss mask 1), in order, are the tokens the
    gateway captured for its calls as the monitor recorded them on each turn's action, with the
    same logprobs; and each rollout's conversion counts agree."""
    conn = sqlite3.connect(run.db)
    conn.row_factory = sqlite3.Row
    try:
        (training,) = conn.execute("SELECT run_name FROM training").fetchone()
        stored = [
            episode_from_json(episodes.to_json(row))
            for row in episodes.training_episodes(conn, training)
        ]
        by_uuid = {
            r["rollout_id"]: r["id"]
            for r in conn.execute("SELECT id, rollout_id FROM rollout WHERE source_type = 'step'")
        }
        checked = 0
        for ep in stored:
            rid = by_uuid[ep.rollout_uuid]
            turns = conn.execute(
                "SELECT t.turn, (SELECT a.tokens FROM action a WHERE a.turn_id = t.id ORDER BY "
                "a.id LIMIT 1) AS tokens, (SELECT a.logprobs FROM action a WHERE a.turn_id = "
                "t.id ORDER BY a.id LIMIT 1) AS logprobs FROM turn t WHERE t.rollout_id = ? "
                "ORDER BY t.turn",
                (rid,),
            ).fetchall()
            trained = [
                i for r in ep.rows for i, m in zip(r.input_ids, r.loss_mask, strict=True) if m
            ]
            trained_lp = [
                p for r in ep.rows for p, m in zip(r.logprobs, r.loss_mask, strict=True) if m
            ]
            (fields,) = conn.execute(
                "SELECT fields_json FROM extra_field WHERE entity_type = 'rollout' "
                "AND entity_id = ?",
                (rid,),
            ).fetchone()
            conv = json.loads(fields)["metrics_json"]["conversion"]
            assert conv["trained_tokens"] == conv["sampled_tokens"] == len(trained), conv
            assert conv["turns"] == len(turns) == len(ep.turns), (conv, len(turns))
            if any(t["tokens"] is None for t in turns):
                continue  # a call whose reply was no action: its tokens are on no action
            sampled = [i for t in turns for i in json.loads(t["tokens"])]
            sampled_lp = [p for t in turns for p in json.loads(t["logprobs"])]
            assert trained == sampled, ep.rollout_uuid
            assert trained_lp == pytest.approx(sampled_lp, abs=1e-6), ep.rollout_uuid
            checked += 1
    finally:
        conn.close()
    assert len(stored) == len(_completed_rollouts(run.db)) >= 8, len(stored)
    assert checked >= len(stored) // 2, (checked, len(stored))
