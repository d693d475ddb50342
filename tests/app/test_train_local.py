"""The main job on the local stack, for real: ``make demo``'s launcher and a crashing run.

The demo's tests read the session's shared demo run (``demo_run``: ``python -m cua_rl.app.demo``
in production's regime, tests/conftest.py ``DEMO``: monitor on SQLite, local gym, local agent,
AReaL's PPOTrainer with its own vLLM CPU server and the tiny Qwen2-VL) and its monitor database.
The last starts train.py against a model folder whose weights cannot be read, so the real PPOTrainer fails
while it starts, and checks that the training is left failed with its error. How a run ends on
SIGTERM or a fail-fast stop: tests/app/test_run_end.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cua_rl.sim.gym import GymServer
from cua_rl.testing.sockets import listening, off_loopback
from tests.conftest import DEMO_STEPS, note_cost
from tests.conftest import db_rows as _rows

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _leftovers(marker: str) -> list[str]:
    """Processes whose command line names ``marker`` (the run folder): none may outlive a run."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


@pytest.mark.timeout(1800)
def test_demo_trains_asynchronously_without_losing_an_episode(demo_run):
    """Six steps with two steps of staleness through the gateway: weight updates land in the
    middle of episodes, yet no episode is rejected and every step accepts all its rows."""
    db = demo_run.run_dir / "monitor.db"
    assert demo_run.returncode == 0, demo_run.output[-6000:]
    steps = _rows(db, "SELECT step, status, metrics_json FROM step ORDER BY step")
    assert [(n, st) for n, st, _ in steps] == [(n, "completed") for n in range(1, DEMO_STEPS + 1)]
    for n, _, metrics in steps:
        m = json.loads(metrics or "{}")
        assert m.get("rollout/accepted") == 1.0, (n, m)
        # Rejection counters are recorded as 0 when nothing was rejected.
        assert not {k: v for k, v in m.items() if "/rejected/" in k and v}, (n, m)
    failed = _rows(db, "SELECT status_message FROM rollout WHERE status = 'failed'")
    assert failed == [], failed
    # Some episodes really did straddle weight updates: their turns carry several versions.
    versions: dict[int, set[int]] = {}
    for rid, mj in _rows(
        db,
        "SELECT t.rollout_id, t.metrics_json FROM turn t JOIN rollout r ON t.rollout_id = r.id "
        "WHERE r.source_type = 'step'",
    ):
        versions.setdefault(rid, set()).update(json.loads(mj or "{}").get("versions", []))
    assert versions and any(len(v) > 1 for v in versions.values()), versions


@pytest.mark.timeout(1800)
def test_a_running_demo_listens_on_loopback_only_and_talks_to_nothing_else(demo_run):
    """Every socket of every process of the run (monitor, gym, agent, trainer, AReaL's workers,
    vLLM), read from the kernel while training episodes ran: listening on 127.0.0.1 / ::1 only,
    connected to loopback only."""
    assert demo_run.returncode == 0, demo_run.output[-3000:]
    assert demo_run.samples_mid_step > 0, "no sample was taken while an episode ran"
    listeners = listening(list(demo_run.sockets))
    # The sample saw the whole run: the trainer's workers and the model server listen too.
    for who in (
        "cua_rl.cpu.rpc_worker",
        "--role actor",
        "--role rollout",
        "cua_rl.inference.vllm_server",
        "cua_rl.sim gym",
    ):
        assert any(who in e.cmd for e in listeners), (who, sorted(map(str, listeners)))
    assert off_loopback(list(demo_run.sockets)) == []


@pytest.mark.timeout(1800)
def test_the_demos_workers_start_forked_from_its_zygote(demo_run):
    """``cpu: true`` under the local scheduler: the actor and rollout workers are forks of the
    run's zygote (cua_rl/cpu/warm_start.py), which imported their modules once, and they are the
    processes that served (listening under their own command lines). The eval rollout worker,
    which AReaL's rollout worker forks with the environment it changed meanwhile, starts cold
    and its log says why."""
    assert demo_run.returncode == 0, demo_run.output[-3000:]
    logs = demo_run.run_dir / "areal" / "logs"
    said = {}
    for role in ("actor", "rollout", "eval-rollout"):
        (log,) = logs.rglob(f"{role}.log")
        said[role] = [x for x in log.read_text().splitlines() if x.startswith("[warm-start]")]
    forked = {}
    for role in ("actor", "rollout"):
        (line,) = [x for x in said[role] if "forked" in x]
        assert line.startswith("[warm-start] worker forked from the zygote: pid "), line
        forked[role] = int(line.rsplit(" ", 1)[1])
    (cold,) = said["eval-rollout"]
    assert cold.startswith(
        "[warm-start] cold start: its environment differs from the first worker's in "
    )
    train_log = (demo_run.run_dir / "logs" / "train.log").read_text(errors="replace")
    assert len(re.findall(r"^\[warm-start\] zygote imported \d+ modules", train_log, re.M)) == 1
    listeners = listening(list(demo_run.sockets))
    for role, pid in forked.items():
        mine = [e for e in listeners if e.pid == pid]
        assert mine and all(f"--role {role} " in e.cmd for e in mine), (role, pid, listeners)


@pytest.mark.timeout(1800)
def test_demo_trains_and_records_everything(demo_run):
    run_dir, text = demo_run.run_dir, demo_run.output
    assert demo_run.returncode == 0, text[-6000:]
    print(text)  # what the terminal showed (pytest -s)

    db = run_dir / "monitor.db"
    assert db.exists(), text[-3000:]
    (status, err, total), *_ = _rows(db, "SELECT status, error_message, total_steps FROM training")
    assert status == "completed", (status, err)

    steps = _rows(db, "SELECT step, status, num_trajectories FROM step ORDER BY step")
    completed = [s for s in steps if s[1] == "completed"]
    assert len(completed) == DEMO_STEPS, steps
    assert all(n and n > 0 for _, _, n in completed), steps

    # Every step's rollouts hang off that step, with turns and token-carrying actions below them.
    n_rollouts = _rows(db, "SELECT COUNT(*) FROM rollout WHERE source_type = 'step'")[0][0]
    assert n_rollouts >= 2 * 2, steps  # two steps of at least one group of two
    assert _rows(db, "SELECT COUNT(*) FROM turn")[0][0] >= n_rollouts
    n_actions = _rows(db, "SELECT COUNT(*) FROM action WHERE num_tokens > 0")[0][0]
    assert n_actions >= n_rollouts
    assert _rows(db, "SELECT COUNT(*) FROM baseline WHERE status = 'completed'")[0][0] == 1

    # Every turn's screenshot is in the monitor's store, referenced by hash.
    uris = [u for (u,) in _rows(db, "SELECT screenshot_uri FROM obs")]
    assert uris and all(u.startswith("sha256:") for u in uris), uris[:3]
    stored = {h for (h,) in _rows(db, "SELECT sha256 FROM screenshot")}
    assert {u.removeprefix("sha256:") for u in uris} <= stored
    assert all((run_dir / "monitor.screenshots" / h[:2] / h).is_file() for h in stored)

    # The terminal: the dashboard's URL first, no worker output, one rounded summary line per
    # step, where things are, and how to browse the database again.
    lines = text.splitlines()
    dashboard = next(i for i, ln in enumerate(lines) if "dashboard: open http://127.0.0.1:" in ln)
    first_step = next(
        i for i, ln in enumerate(lines) if ln.startswith(f"[demo] step 1/{DEMO_STEPS}: ")
    )
    assert dashboard < first_step
    assert "(AReaL)" not in text and "INFO" not in text, text[-3000:]
    summaries = [
        ln
        for ln in lines
        if re.match(rf"\[demo\] step \d/{DEMO_STEPS}: trained on \d+ episodes \(\d+ rows\), ", ln)
    ]
    want = [f"[demo] step {n}/{DEMO_STEPS}" for n in range(1, DEMO_STEPS + 1)]
    assert [ln.split(":")[0] for ln in summaries] == want
    for ln in summaries:
        # Rounded: no number with more than 2 decimals.
        assert not re.search(r"\d\.\d{3,}", ln), ln
    assert len(lines) < 80, f"{len(lines)} lines:\n{text}"
    assert f"monitor database: {db}" in text
    assert f"python -m cua_rl.monitor serve --db {db}" in lines[-1], lines[-3:]
    logs_line = next(ln for ln in lines if ln.startswith("[demo] logs: "))
    assert "train.log" in logs_line and "agent.log" in logs_line, logs_line
    assert (run_dir / "logs" / "train.log").stat().st_size > 10_000
    assert not _leftovers(str(run_dir)), _leftovers(str(run_dir))
    _recorded_config_is_the_config_that_ran(db)


@pytest.mark.timeout(1800)
def test_the_progress_line_names_the_phase_of_its_step(demo_run):
    """Every change of the live line the demo read (logs/progress.log): a step's line names the
    step's own phase (its rollouts, ppo_update, update_weights; the last step, once committed,
    while the drain closes the episodes beyond it: completed), never a pass's "evaluation", and
    the steps were seen rolling out."""
    assert demo_run.returncode == 0, demo_run.output[-3000:]
    lines = (demo_run.run_dir / "logs" / "progress.log").read_text().splitlines()
    step_lines = [ln.split(" ", 1)[1] for ln in lines if re.match(r"\S+ step \d+/\d+ · ", ln)]
    phases = {ln.split(" · ")[1] for ln in step_lines}
    assert "rollout" in phases, step_lines
    assert phases <= {"rollout", "training", "weight update", "completed"}, step_lines
    passes = [ln for ln in lines if " baseline (before step 1) · " in ln or " eval after " in ln]
    assert passes and all(ln.split(" · ")[1] in ("rollout", "aggregation") for ln in passes)


@pytest.mark.timeout(1800)
def test_the_finished_demo_leaves_its_database_whole_in_one_file(demo_run, tmp_path):
    import shutil

    assert demo_run.returncode == 0, demo_run.output[-3000:]
    assert not demo_run.db.with_name("monitor.db-wal").exists()
    copy = tmp_path / "monitor.db"
    shutil.copy(demo_run.db, copy)  # the file alone, as a user copies it
    steps = _rows(copy, "SELECT status FROM step")
    assert steps == [("completed",)] * DEMO_STEPS, steps


@pytest.mark.timeout(1800)
def test_every_command_the_demo_prints_runs_as_printed(demo_run, tmp_path):
    """The training command and the one that serves the database again, each with the
    environment's interpreter: --help knows their options, and the serve command, run as
    printed (on a free port), serves the run's database."""
    from cua_rl.app.demo import Child, free_port, wait_http
    from tests.common.commands import help_of, help_problems, printed_commands, problems

    assert demo_run.returncode == 0, demo_run.output[-3000:]
    commands = printed_commands(demo_run.output)
    assert [c.target for c in commands] == [
        ("-m", "examples.cua_agent.train"),
        ("-m", "cua_rl.monitor", "serve"),
    ], demo_run.output
    for cmd in commands:
        assert not problems(cmd), (cmd.text, problems(cmd))
        assert not help_problems(cmd, help_of(cmd)), cmd.text
    serve, port = commands[1], free_port()
    argv = [str(port) if a == "8765" else a for a in serve.args]
    child = Child("serve", [str(ROOT / serve.interpreter), "-m", serve.module, *argv], tmp_path)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", 60)
        resp = httpx.get(f"http://127.0.0.1:{port}/api/trainings", timeout=10)
    finally:
        child.stop()
    assert resp.status_code == 200 and len(resp.json()["trainings"]) == 1, resp.text[:500]


def _flat(value, prefix: str = "") -> dict:
    """A config as dotted keys (list items by index), JSON's types."""
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()
        }
    if isinstance(value, list | tuple):
        return {
            k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}{i}.").items()
        }
    return {prefix.rstrip("."): value}


def _recorded_config_is_the_config_that_ran(db: Path) -> None:
    """config_json, field by field: AReaL's own dump of the config it loaded (config.yaml in the
    run's log folder: every default and derived value), with exactly the CPU harness's changes
    (docs/areal-cpu.md) and the claimed run name on top. The record's own columns come from the
    same config."""
    import yaml

    ((config_json, log_path, *columns),) = _rows(
        db,
        "SELECT config_json, log_path, lora_rank, groups_per_batch, num_substeps, box_type, "
        "wandb_project, wandb_name, group_size, batch_size FROM training",
    )
    recorded = _flat(json.loads(config_json))
    loaded = yaml.load((Path(log_path) / "config.yaml").read_text(), Loader=yaml.FullLoader)
    loaded = _flat(json.loads(json.dumps(loaded, default=str)))
    vllm_python = os.environ.get("CUA_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    cpu = {
        "vllm.block_size": 32,
        "vllm.distributed_executor_backend": "uni",
        "vllm.kv_cache_memory_bytes": 128 * 1024 * 1024,
        "vllm.worker_extension_cls": "cua_rl.inference.vllm_worker.DiskWeightReloadExtension",
    }
    for role in ("actor", "rollout"):
        spec = f"{role}.scheduling_spec.0"
        cpu |= {
            f"{spec}.cmd": "python -m cua_rl.cpu.rpc_worker",
            f"{spec}.cpu": 1,
            f"{spec}.env_vars.CUA_VLLM_PYTHON": vllm_python,
            f"{spec}.env_vars.VLLM_CPU_OMP_THREADS_BIND": "nobind",
            f"{spec}.env_vars.OMP_WAIT_POLICY": "PASSIVE",
            f"{spec}.env_vars.VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
    # The record's name, claimed before the record (run_record.py): a new database, the default.
    cpu["monitor.run_name"] = f"{loaded['experiment_name']}-{loaded['trial_name']}"
    differ = {k for k in recorded.keys() | loaded.keys() if recorded.get(k) != loaded.get(k)}
    assert {k: recorded.get(k) for k in differ} == cpu
    # configs/local.yaml: no LoRA, 2 tasks x 2 samples a step, 1 minibatch, a phone, no W&B.
    assert columns == [None, 2, 1, "android", None, None, 2, 2]


@pytest.mark.timeout(900)
def test_a_crashing_run_leaves_the_training_failed_with_its_error(tmp_path, tiny_vl_model_dir):
    # A folder the launch checks accept (a real config.json beside a weights file) whose weights
    # cannot be read: the run starts, is recorded, and dies loading them. (An empty folder is a
    # config error now, reported before the monitor is written to: test_config_load.py.)
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    shutil.copy(Path(tiny_vl_model_dir) / "config.json", not_a_model / "config.json")
    (not_a_model / "model.safetensors").write_bytes(b"not a safetensors file")
    db = tmp_path / "monitor.db"
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    t0 = time.monotonic()
    # Files, not pipes: a worker left running would hold a pipe open and hang the test.
    with GymServer() as gym, out.open("w") as out_f, err.open("w") as err_f:
        returncode = subprocess.run(
            [
                sys.executable,
                "-m",
                "examples.cua_agent.train",
                "--config",
                "configs/local.yaml",
                f"actor.path={not_a_model}",
                f"gym.base_url={gym.url}",
                f"monitor.db_path={db}",
                f"cluster.fileroot={tmp_path / 'areal'}",
                f"cluster.name_resolve.nfs_record_root={tmp_path / 'name_resolve'}",
            ],
            cwd=ROOT,
            stdout=out_f,
            stderr=err_f,
            timeout=800,
        ).returncode
    note_cost("crash at start", time.monotonic() - t0)
    proc = subprocess.CompletedProcess([], returncode, out.read_text(), err.read_text())
    assert proc.returncode != 0, proc.stdout[-3000:]
    # The actor's worker had started when its engine failed to load: it stopped with the run.
    left = _leftovers(str(tmp_path))
    for line in left:
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not left, left
    rows = _rows(db, "SELECT status, error_message FROM training")
    assert len(rows) == 1, rows
    status, err = rows[0]
    assert status == "failed"
    # The recorded error is the exception the process died of, as its traceback shows it.
    assert err, rows
    assert err.splitlines()[0].split(": ", 1)[-1] in proc.stderr, (err, proc.stderr[-3000:])
    history = _rows(
        db,
        "SELECT new_status FROM status_history WHERE entity_type = 'training' ORDER BY id",
    )
    # (A crash this early can reach the monitor in the same batch as the start: the client merges
    # the two updates of one record, so "running" need not appear in the history.)
    assert history and history[-1][0] == "failed", history
