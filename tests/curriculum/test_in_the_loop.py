"""The curriculum in a real training on the local stack, stopped and resumed by AReaL's recover.

Local gym and agent, the embedded monitor on a SQLite file, AReaL's PPOTrainer with the
session's shared vLLM CPU server (borrowed by both runs) and the tiny Qwen2-VL. The first run trains two steps with ``curriculum.kind=ucb`` and
zero-variance groups dropped, writing a recover checkpoint after each step; the second run, a
new process on the same trial, recovers and trains a third step with the drop turned off. The
checks read the curriculum's decision log and the monitor's database:

- every batch is what the selector gives for the outcomes it read, and those outcomes are the
  ones the monitor recorded; every rollout the trainer ran is of a task the selector drew;
- the resumed run loads the selector state the first run checkpointed, and goes on from it;
- zero-variance groups are dropped and counted while the option is on, never while it is off;
- the step records carry the curriculum's stats.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from contextlib import closing
from pathlib import Path

import pytest

from cua_rl.curriculum.selector import CurriculumConfig, TaskEstimate, select_batch
from cua_rl.sim.agent import AgentServer
from cua_rl.sim.gym import GymServer
from tests.conftest import note_cost

ROOT = Path(__file__).resolve().parents[2]
GROUP = 2

pytestmark = pytest.mark.slow


def _train(
    tmp_path: Path, gym, agent, model_dir, warm_env, *overrides: str
) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.cua_agent.train",
            "--config",
            "configs/local.yaml",
            f"actor.path={model_dir}",
            f"gym.base_url={gym.url}",
            f"agent.base_url={agent.url}",
            f"monitor.db_path={tmp_path / 'monitor.db'}",
            f"cluster.fileroot={tmp_path / 'areal'}",
            f"cluster.name_resolve.nfs_record_root={tmp_path / 'name_resolve'}",
            # 9 easy and normal tasks: 7 train, 2 eval (not run: evals cost time, not the point).
            "gym.selection.tags=[easy,normal]",
            "evaluator.eval_before_train=false",
            "evaluator.freq_steps=null",
            f"gconfig.n_samples={GROUP}",
            "total_train_epochs=3",
            "curriculum.kind=ucb",
            "+curriculum.seed=17",
            "recover.mode=on",
            "+recover.freq_steps=1",
            # local.yaml's shaped rewards are multiples of 0.1, mostly -0.1 to -0.4 here (a
            # success adds 1); rewards within 0.25 of each other count as equal, so four to nine
            # groups in ten are zero-variance and the drop is surely exercised, while a step
            # still fills (the tolerance reaches the rollout workers through train.py).
            "+curriculum.zero_variance_tol=0.25",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1100,
        env={**os.environ, **warm_env},
    )
    note_cost(f"curriculum {overrides[-1]}", time.monotonic() - t0)
    return proc


def _rows(db: Path, sql: str) -> list[tuple]:
    with closing(sqlite3.connect(db)) as con:
        return con.execute(sql).fetchall()


def _decisions(tmp_path: Path) -> list[dict]:
    (path,) = (tmp_path / "areal").rglob("curriculum.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(2400)
def test_ucb_batches_follow_the_outcomes_and_survive_a_restart(
    tmp_path, tiny_vl_bpe_model_dir, model_servers, warm_env
):
    db = tmp_path / "monitor.db"
    borrow = model_servers("qwen2-vl-bpe").borrow_override()
    with GymServer() as gym, AgentServer() as agent:
        first = _train(
            tmp_path,
            gym,
            agent,
            tiny_vl_bpe_model_dir,
            warm_env,
            borrow,
            "total_train_steps=2",
            "curriculum.drop_zero_variance=true",
        )
        assert first.returncode == 0, (first.stdout[-3000:], first.stderr[-6000:])
        second = _train(
            tmp_path,
            gym,
            agent,
            tiny_vl_bpe_model_dir,
            warm_env,
            borrow,
            "total_train_steps=3",
            "curriculum.drop_zero_variance=false",
        )
        assert second.returncode == 0, (second.stdout[-3000:], second.stderr[-6000:])
    print(first.stdout[-2000:], second.stdout[-2000:], sep="\n")

    # The gym gives eval tasks, but neither run evaluates: no eval rollout worker in either.
    roles = [
        re.findall(r"Creating \d+ workers for role '([\w-]+)'", log.read_text(errors="replace"))
        for log in sorted((tmp_path / "areal" / "logs").rglob("main.log"))
    ]
    assert roles and all(r and set(r) == {"actor", "rollout"} for r in roles), roles

    # The monitor: one training, three completed steps (the third by the resumed run).
    ((status, training_id),) = _rows(db, "SELECT status, id FROM training")
    assert status == "completed"
    steps = {
        s: (st, json.loads(m or "{}"))
        for s, st, m in _rows(db, "SELECT step, status, metrics_json FROM step ORDER BY step")
    }
    assert [s for s, (st, _) in steps.items() if st == "completed"] == [1, 2, 3], steps.keys()
    train_tasks = [t for (t,) in _rows(db, "SELECT task_id FROM task WHERE source_type = 'train'")]
    assert len(train_tasks) == 7

    log = _decisions(tmp_path)
    draws = [r for r in log if r["event"] == "draw"]
    assert draws, log

    # 1. Each batch is the selector's answer to the estimates it logged, with the run's seed.
    config = CurriculumConfig(kind="ucb", seed=17)
    task_lists = [r["task_ids"] for r in log if r["event"] == "tasks"]
    assert len(task_lists) == 2 and task_lists[0] == task_lists[1]  # one per run, same order
    ids = task_lists[0]
    assert sorted(ids) == sorted(train_tasks)
    for d in draws:
        assert d["seed"] == 17
        est = [TaskEstimate(*d["estimates"].get(t, (0, 0.0, 0.0, 0.0))) for t in ids]
        sel = select_batch(est, 2, group_size=GROUP, config=config, seed=17, batch_index=d["batch"])
        assert list(sel.indices) == d["indices"], d
        assert [ids[i] for i in sel.indices] == d["chosen"]

    # 2. The estimates came from the monitor's records: never more tries than it holds, and the
    # draws after the first step saw the outcomes of the steps before.
    recorded = Counter(
        t
        for (t,) in _rows(
            db,
            "SELECT t.task_id FROM rollout r JOIN task t ON t.id = r.task_id "
            "WHERE r.source_type = 'step' AND r.status = 'completed' AND r.reward IS NOT NULL",
        )
    )
    for d in draws:
        for task, (tries, *_rest) in d["estimates"].items():
            assert tries <= recorded[task], (task, tries, recorded[task])
    assert draws[0]["estimates"] == {} and draws[0]["never_tried"] == 7
    assert sum(e[0] for e in draws[-1]["estimates"].values()) >= 2 * GROUP * 2

    # 3. Every rollout the trainer ran is of a drawn task, at most a group per draw of it.
    drawn = Counter(t for d in draws for t in d["chosen"])
    ran = Counter(
        t
        for (t,) in _rows(
            db,
            "SELECT t.task_id FROM rollout r JOIN task t ON t.id = r.task_id "
            "WHERE r.source_type = 'step'",
        )
    )
    assert ran and all(ran[t] <= GROUP * drawn[t] for t in ran), (ran, drawn)

    # 4. The resumed run loaded the state the first run checkpointed last, and went on from it.
    loaded_at = next(i for i, r in enumerate(log) if r["event"] == "state_loaded")
    saved = [r for r in log[:loaded_at] if r["event"] == "state_saved"]
    assert len(saved) == 2, [r["event"] for r in log]  # a checkpoint after each step
    assert log[loaded_at]["state"] == saved[-1]["state"]
    after = [r for r in log[loaded_at:] if r["event"] == "draw"]
    assert after and after[0]["batch"] == saved[-1]["state"]["batches_drawn"]
    assert [r["event"] for r in log].count("state_loaded") == 1

    # 5. Zero-variance groups: dropped and counted while on (steps 1-2), never while off (3).
    dropped = 0.0
    for step in (1, 2):
        m = steps[step][1]
        zero = m["rollout/cua/group/zero_variance"]
        complete = 1 - m["rollout/cua/group/rejected/incomplete"]
        # Every zero-variance group among the complete ones was dropped.
        assert m["rollout/cua/group/rejected/zero_variance"] == pytest.approx(zero * complete)
        dropped += m["rollout/cua/group/rejected/zero_variance"]
    # With at least four groups in five zero-variance, two steps without a drop is at most a
    # 1-in-500 run.
    assert dropped > 0, {s: steps[s][1] for s in (1, 2)}
    off = steps[3][1]
    assert "rollout/cua/group/zero_variance" in off
    assert "rollout/cua/group/rejected/zero_variance" not in off

    # 6. Each step's record carries the curriculum's stats.
    for step in (1, 2, 3):
        m = steps[step][1]
        assert 0 <= m["curriculum/never_tried"] <= 7
        assert m["curriculum/batches_drawn"] >= 1
    assert steps[1][1]["curriculum/draws"] >= 1 and "curriculum/sampled_success" in steps[1][1]
    for out in (first.stdout, second.stdout):
        assert "never_tried=" in out
    print("draws", len(draws), "drawn", dict(drawn), "ran", dict(ran))
    print(
        {
            s: {k: v for k, v in m.items() if "group" in k or "curriculum" in k}
            for s, (_, m) in steps.items()
        }
    )
