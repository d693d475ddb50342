"""configs/local.yaml trained under AReaL's Ray scheduler on a two-node Ray cluster on this machine.

``python -m cua_rl.app.demo --ray`` (what ``make demo-ray`` runs): the monitor, the local gym
and agent, a Ray head and a second node on loopback, then two asynchronous PPO steps with
AReaL's actor and rollout workers as Ray actors (the rollout worker borrowing the session's vLLM
server). Afterwards: both steps completed with every
episode accepted, the monitor recorded every rollout finished, the workers ran on two different
nodes (the GCS's actor table, saved by the demo), and nothing the run started is left.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -r requirements/ray.txt)")

from tests.conftest import NO_LATENCY, db_rows, run_demo  # noqa: E402

pytestmark = pytest.mark.slow


def _leftovers(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


@pytest.mark.timeout(1200)
def test_two_async_steps_on_a_two_node_ray_cluster(tmp_path, tiny_vl_bpe_model_dir, model_servers):
    run_dir = tmp_path / "demo-ray"
    # The rollout worker, a Ray actor, borrows the session's server instead of starting one.
    server = model_servers("qwen2-vl-bpe")
    run = run_demo(
        run_dir, "--ray", "--quiet", *NO_LATENCY, server=server, timeout=1100, name="ray training"
    )
    text = run.output
    assert run.returncode == 0, text[-6000:]

    db = run_dir / "monitor.db"
    assert db_rows(db, "SELECT status FROM training") == [("completed",)]
    steps = db_rows(db, "SELECT step, status, metrics_json FROM step ORDER BY step")
    assert [(n, st) for n, st, _ in steps] == [(1, "completed"), (2, "completed")], steps
    for n, _, metrics in steps:
        m = json.loads(metrics or "{}")
        assert m.get("rollout/accepted") == 1.0, (n, m)
        assert not {k: v for k, v in m.items() if "/rejected/" in k and v}, (n, m)
    # No episode lost: every rollout the monitor saw was closed, none failed and none is left
    # running; the only other end is "cancelled", for episodes of a step after the last that
    # were running when the training ended (asynchronous rollouts run ahead).
    statuses = dict(db_rows(db, "SELECT status, COUNT(*) FROM rollout GROUP BY status"))
    assert set(statuses) <= {"completed", "cancelled"} and statuses.get("completed"), statuses
    assert db_rows(db, "SELECT COUNT(*) FROM rollout WHERE source_type = 'step'")[0][0] >= 8

    # Asynchronous: the run allowed one step of staleness (configs/local.yaml, as AReaL read it).
    (config_dump,) = (run_dir / "areal" / "logs").rglob("config.yaml")
    assert re.search(r"max_head_offpolicyness: 1\b", config_dump.read_text())

    # The actor and rollout workers were Ray actors on two different nodes.
    placement = {
        a["name"]: a["node_id"]
        for a in json.loads((run_dir / "logs" / "ray-actors.json").read_text())
    }
    assert {"actor/0", "rollout/0"} <= set(placement), placement
    assert placement["actor/0"] != placement["rollout/0"], placement

    # The cluster and everything the run started are gone.
    session = re.search(r"session files (\S+)\)", text).group(1)
    assert not Path(session).exists(), session
    assert not _leftovers(session), _leftovers(session)
    assert not _leftovers(str(run_dir)), _leftovers(str(run_dir))
