"""The free-reward counter in a real training, and a training that leaves flagged tasks out.

One audit, then one short training of the demo's stack (``python -m cua_rl.app.demo``: AReaL's
trainer, the session's borrowed vLLM CPU server, the local gym and agent, the monitor). The
gym serves ``free_reward_tasks.yaml``: a task that pays at once and that the lenient agent's
taps cannot change (its episodes are rewarded while no action changes the state), and a task
whose validator reads a random number. The audit, recorded in the run's monitor database,
flags the second; the training (``curriculum.skip_flagged``, read from that monitor over HTTP)
trains on the first and the built-in sim-004 and counts, per step, the rewarded episodes in which
no action changed the state: in its stats, its warning line and its dashboard curve.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from cua_rl.audit.live import step_share
from cua_rl.monitor.server import views
from cua_rl.monitor.server.read import MonitorReader
from tests.audit.conftest import HERE, REPO
from tests.conftest import NO_LATENCY, run_demo

pytestmark = pytest.mark.slow

TASKS = HERE / "free_reward_tasks.yaml"
SELECT = (
    "gym.selection.task_names=[user-free-camera,user-coin-flip,sim-004-open-calculator]",
    "gym.selection.tags=[]",
    "gym.selection.eval_number_range=null",
    "gym.selection.train_ratio=1.0",
)


def _rows(db, sql: str, *args) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def test_a_training_counts_free_reward_and_leaves_the_flagged_task_out(
    tmp_path, model_servers, warm_env
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    db = run_dir / "monitor.db"
    audit = subprocess.run(
        [
            sys.executable, "-m", "cua_rl.audit",
            "--local-gym", f"--task-file {TASKS}",
            "--config", "configs/local.yaml",
            f"monitor.db_path={db}",
            f"cluster.fileroot={tmp_path / 'audit'}",
            "audit.agents=[replay]",
            *SELECT,
        ],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert audit.returncode == 1, audit.stdout + audit.stderr
    assert ": 1 flaky, 1 clean" in audit.stdout, audit.stdout

    run = run_demo(
        run_dir,
        "--gym-args", f"--task-file {TASKS}", *NO_LATENCY,
        "curriculum.skip_flagged=true",
        *SELECT,
        "total_train_epochs=2",
        "total_train_steps=2",
        server=model_servers("qwen2-vl-bpe"), timeout=1500, name="audit: free reward",
        env=warm_env,
    )  # fmt: skip
    assert run.returncode == 0, run.output[-4000:]
    train_log = (run_dir / "logs" / "train.log").read_text(errors="replace")
    assert (
        "audit: leaving out 1 flagged of the 3 selected tasks: user-coin-flip (flaky)" in train_log
    )

    trained = _rows(
        db,
        "SELECT DISTINCT t.task_id FROM rollout r JOIN task t ON t.id = r.task_id "
        "WHERE r.source_type = 'step'",
    )
    assert {r[0] for r in trained} == {"user-free-camera", "sim-004-open-calculator"}

    # Each step's stats: the share of free reward among the episodes that ended since the step
    # before (a step whose batch had ended before then has none: asynchronous training).
    shares = []
    for _step, metrics in _rows(db, "SELECT step, metrics_json FROM step ORDER BY step"):
        stats = json.loads(metrics or "{}")
        if step_share(stats) is not None:
            shares.append(step_share(stats))
            assert 0 <= shares[-1] <= 1
            assert step_share(stats, "rollout/cua/state_unknown") == 0  # the local gym says
    assert shares and max(shares) > 0
    # Each rollout's mark: every free-camera episode pays with no state change (bar a rare valid
    # back() or home() of the tiny model), no sim-004 episode does (opening the app changes the
    # screen), and the marks are the dashboard's per-step counts.
    marks = _rows(
        db,
        "SELECT t.task_id, json_extract(x.fields_json, '$.free_reward'), "
        "json_extract(x.fields_json, '$.state_effect'), r.step_id FROM rollout r "
        "JOIN task t ON t.id = r.task_id JOIN extra_field x "
        "ON x.entity_type = 'rollout' AND x.entity_id = r.id "
        "WHERE r.source_type = 'step' AND r.status = 'completed'",
    )
    free = [m for m in marks if m[0] == "user-free-camera"]
    assert free and sum(m[1] for m in free) >= len(free) - 1
    assert all(m[1] == 0 for m in marks if m[0] == "sim-004-open-calculator")
    warned = [line for line in run.output.splitlines() if "were rewarded though no action" in line]
    assert warned, run.output[-3000:]
    assert "python -m cua_rl.audit" in warned[0]

    read = MonitorReader(db)
    try:
        (training,) = _rows(db, "SELECT id FROM training")
        now = views.parse_time("2100-01-01 00:00:00")
        page = views.training_page(read, training[0], now=now, stale_after_s=300)
    finally:
        read.close()
    chart = next(c for c in page["charts"] if c["id"] == "free_reward")
    curve = dict(chart["series"])["no action changed the state"]
    step_ids = dict(_rows(db, "SELECT step, id FROM step"))
    per_step = {s: sum(m[1] for m in marks if m[3] == step_ids[s]) for s in chart["x"]}
    assert curve == [per_step[s] for s in chart["x"]]
    assert sum(curve) == sum(m[1] for m in marks) >= 1
