"""configs/local.yaml trained under AReaL's Slurm scheduler on a single-node Slurm on this machine.

``python -m cua_rl.app.demo --slurm``: munged, slurmctld and slurmd on loopback
(``cua_rl/cpu/slurm_cluster.py``), AReaL's actor and rollout workers as ``sbatch`` jobs running
natively, two asynchronous PPO steps. Skipped, with the reason, where the daemons cannot start
(the packages missing, not root).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from cua_rl.cpu.slurm_cluster import missing
from tests.conftest import db_rows, run_demo

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1200)
def test_two_async_steps_through_slurm(tmp_path, tiny_vl_bpe_model_dir):
    why = missing()
    if why:
        pytest.skip(f"no local Slurm: {why}")
    run_dir = tmp_path / "demo-slurm"
    run = run_demo(run_dir, "--slurm", "--quiet", timeout=1100, name="slurm training")
    assert run.returncode == 0, run.output[-6000:]

    db = run_dir / "monitor.db"
    assert db_rows(db, "SELECT status FROM training") == [("completed",)]
    steps = db_rows(db, "SELECT step, status, metrics_json FROM step ORDER BY step")
    assert [(n, st) for n, st, _ in steps] == [(1, "completed"), (2, "completed")], steps
    for n, _, metrics in steps:
        assert json.loads(metrics or "{}").get("rollout/accepted") == 1.0, n
    statuses = dict(db_rows(db, "SELECT status, COUNT(*) FROM rollout GROUP BY status"))
    assert set(statuses) <= {"completed", "cancelled"} and statuses.get("completed"), statuses

    # The workers really were Slurm jobs: AReaL wrote one sbatch script per role.
    scripts = sorted(p.name for p in (run_dir / "areal").rglob("*.sh"))
    assert {"actor.sh", "rollout.sh"} <= set(scripts), scripts
    # Nothing of the run is left: no job process, no daemon of this Slurm.
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    left = [line for line in out.splitlines() if str(run_dir) in line and "ps -eo" not in line]
    assert left == [], left
