"""``make demo``'s terminal lines, read from a real monitor database written through the store."""

from __future__ import annotations

import io

from cua_rl.app.progress import DemoProgress
from cua_rl.monitor.server.store import MonitorStore

RUN = "progress-run"


def _batch(step_status: str = "completed", rollouts: tuple[str, ...] = ()) -> dict:
    step = f"step-{RUN}-1-0"
    return {
        "training": {
            "client_id": RUN, "run_name": RUN, "log_path": "l", "model_name": "m",
            "status": "running", "current_step": 1, "total_steps": 2, "current_phase": "rollout",
        },
        "tasks": [{"client_id": "t", "task_id": "t", "name": "t", "description": "d"}],
        "steps": [{
            "client_id": step, "training_client_id": RUN, "step": 1, "batch": 0,
            "status": step_status, "reward_mean": -0.22499999403953552,
            "reward_std": 0.04330127018922193, "num_tokens": 136, "num_trajectories": 4,
            "start_time": "2026-01-01 00:00:00", "end_time": "2026-01-01 00:00:41.6",
            "metrics_json": {
                "rollout/cua/success": 0.25, "rollout/cua/reward": -0.22499999403953552,
                "ppo_actor/task_reward/avg": -0.15000000596046448,
                "ppo_actor/n_seqs": 12.0,
            },
        }],
        "evals": [{"client_id": f"eval-{RUN}-1", "training_client_id": RUN, "step": 1,
                   "model_path": "m", "status": "completed", "success_rate": 0.5}],
        "rollouts": [
            {"client_id": f"r{i}", "rollout_id": f"r{i}", "step_client_id": step,
             "task_client_id": "t", "model_path": "m", "status": status,
             "reward": -0.30000001192092896 if status == "completed" else None,
             "task_success": 0, "end_time": f"2026-01-01 00:00:0{i}"}
            for i, status in enumerate(rollouts)
        ],
    }  # fmt: skip


def test_a_running_step_shows_one_live_line(tmp_path):
    store = MonitorStore(tmp_path / "m.db")
    store.ingest(_batch("rollout_running", ("completed", "running", "running", "failed")))
    out = io.StringIO()
    progress = DemoProgress(tmp_path / "m.db", out, prefix="[demo] ", quiet_s=0)
    progress.tick()
    progress.tick()  # unchanged: not printed again
    progress.close()
    store.close()
    assert out.getvalue().splitlines() == [
        "[demo] step 1/2 · rollout · episodes 1 finished, 2 running, 1 rejected "
        "· last reward -0.30, success no"
    ]


def test_the_live_line_shows_the_phase_the_step_is_in(tmp_path):
    """The training's record names one phase for the whole run (a step's, or "evaluation" while
    a pass runs); the line shows the step's own phase, as the hooks record it, whatever the
    training's says: rollout, then training (ppo_update), then the weight update
    (update_weights)."""
    store = MonitorStore(tmp_path / "m.db")
    batch = _batch("rollout_running", ("running", "running"))
    batch["training"]["current_phase"] = "evaluation"
    batch["steps"][0]["current_phase"] = "rollout_execution"
    store.ingest(batch)
    out = io.StringIO()
    progress = DemoProgress(tmp_path / "m.db", out, quiet_s=0)
    progress.tick()
    step = {"client_id": f"step-{RUN}-1-0", "status": "training"}
    store.ingest({"steps": [{**step, "current_phase": "training"}]})
    progress.tick()
    store.ingest({"steps": [{**step, "current_phase": "checkpointing"}]})
    progress.tick()
    progress.close()
    store.close()
    phases = [line.split(" · ")[1] for line in out.getvalue().splitlines()]
    assert phases == ["rollout", "training", "weight update"], out.getvalue()


def test_the_log_keeps_every_change_the_terminal_thins_out(tmp_path):
    store = MonitorStore(tmp_path / "m.db")
    store.ingest(_batch("rollout_running", ("running", "running")))
    out = io.StringIO()
    log = tmp_path / "progress.log"
    progress = DemoProgress(tmp_path / "m.db", out, quiet_s=3600, log_path=log)
    progress.tick()
    store.ingest({"rollouts": [{"client_id": "r0", "status": "completed", "reward": 0.5}]})
    progress.tick()
    progress.tick()  # unchanged: not logged again
    progress.close()
    store.close()
    # The terminal got the first line only (the next came within quiet_s); the log got both.
    assert len(out.getvalue().splitlines()) == 1
    logged = [line.split(" ", 1)[1] for line in log.read_text().splitlines()]
    assert logged == [
        "step 1/2 · rollout · episodes 0 finished, 2 running, 0 rejected",
        "step 1/2 · rollout · episodes 1 finished, 1 running, 0 rejected "
        "· last reward 0.50, success no",
    ]


def test_a_completed_step_gets_one_rounded_summary_line(tmp_path):
    store = MonitorStore(tmp_path / "m.db")
    store.ingest(_batch("completed", ("completed", "completed", "completed", "cancelled")))
    out = io.StringIO()
    progress = DemoProgress(tmp_path / "m.db", out, quiet_s=3600)
    progress.tick()
    progress.tick()
    progress.close()
    store.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        # An episode cancelled when the run ended was stopped: neither accepted nor rejected.
        "step 1/2: trained on 4 episodes (12 rows), 136 tokens, finished since the step "
        "before: 3 accepted, 0 rejected, reward -0.22 ± 0.04, success 25%, eval success 50%, 42s"
    )
    assert len([ln for ln in lines if ln.startswith("step 1/2:")]) == 1


def test_no_database_yet_prints_nothing(tmp_path):
    out = io.StringIO()
    progress = DemoProgress(tmp_path / "absent.db", out)
    progress.tick()
    progress.close()
    assert out.getvalue() == ""
    assert not (tmp_path / "absent.db").exists()  # read-only: never creates the file


def test_an_eval_pass_is_named_after_its_step_and_a_finished_run_has_no_live_line(tmp_path):
    store = MonitorStore(tmp_path / "m.db")
    store.ingest(_batch("completed", ("completed",)))
    store.ingest(
        {"evals": [{"client_id": f"eval-{RUN}-1", "status": "running", "current_phase": "rollout"}]}
    )
    out = io.StringIO()
    progress = DemoProgress(tmp_path / "m.db", out, quiet_s=0)
    progress.tick()
    store.ingest({"training": {"client_id": RUN, "run_name": RUN, "status": "completed"}})
    progress.tick()
    progress.close()
    store.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/2: trained on 4 episodes (12 rows)")
    assert lines[1:] == [
        "eval after step 1/2 · rollout · episodes 0 finished, 0 running, 0 rejected"
    ]


def test_a_step_counts_the_episodes_that_finished_since_the_step_before(tmp_path):
    """Asynchronous steps train on batches that finished earlier: each step line counts the
    episodes that ended after the previous step's end, whichever policy sampled them."""
    store = MonitorStore(tmp_path / "m.db")
    batch = _batch("completed", ("completed", "completed"))
    step2 = {
        **batch["steps"][0],
        "client_id": f"step-{RUN}-2-0",
        "step": 2,
        "start_time": "2026-01-01 00:00:41.6",
        "end_time": "2026-01-01 00:01:00",
        # No episode reached the stats of this window: nothing but the trained batch's size.
        "reward_mean": -0.4, "reward_std": None, "metrics_json": {"ppo_actor/n_seqs": 4.0},
    }  # fmt: skip
    batch["steps"].append(step2)
    # Sampled by step 1's policy, but finished after step 1 ended: step 2's line counts them.
    batch["rollouts"] += [
        {**batch["rollouts"][0], "client_id": f"late{i}", "rollout_id": f"late{i}",
         "status": status, "end_time": f"2026-01-01 00:00:5{i}"}
        for i, status in enumerate(("completed", "failed", "completed"))
    ]  # fmt: skip
    store.ingest(batch)
    out = io.StringIO()
    progress = DemoProgress(tmp_path / "m.db", out, quiet_s=3600)
    progress.tick()
    progress.close()
    store.close()
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("step ")]
    assert "finished since the step before: 2 accepted, 0 rejected" in lines[0], lines
    assert lines[1] == (
        "step 2/2: trained on 4 episodes (4 rows), 136 tokens, "
        "finished since the step before: 2 accepted, 1 rejected, 18s"
    ), lines
