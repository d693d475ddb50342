"""The local Ray cluster itself: two nodes, loopback only, and nothing left once stopped.

Real ``ray start`` processes; the driver is this test process's child (a short-lived Python),
as train.py would be. Every listening socket of every process of the cluster is read from the
kernel (``ss``) and must be on 127.0.0.1.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -r requirements/ray.txt)")
psutil = pytest.importorskip("psutil", reason="psutil comes with Ray")

from cua_rl.cpu.ray_cluster import LocalRayCluster  # noqa: E402

pytestmark = pytest.mark.slow

# Two actors of one CPU each on nodes of one CPU each: Ray must place them on different nodes.
DRIVER = """
import sys
from cua_rl.cpu.ray_cluster import keep_loopback
keep_loopback()
import ray
ray.init(address=sys.argv[1], logging_level="ERROR")

@ray.remote(num_cpus=1)
class Probe:
    def ping(self):
        return 1

probes = [Probe.options(name=f"probe/{i}").remote() for i in range(2)]
ray.get([p.ping.remote() for p in probes])
print("ok")
"""


def _listeners(pids: list[int]) -> list[str]:
    out = subprocess.run(["ss", "-H", "-ltnup"], capture_output=True, text=True, check=True)
    return [
        line.split()[4]
        for line in out.stdout.splitlines()
        if any(f"pid={pid}," in line for pid in pids)
    ]


def test_two_nodes_on_loopback_spread_actors_and_stop_completely(tmp_path):
    cluster = LocalRayCluster(tmp_path / "logs", nodes=2, cpus_per_node=1)
    cluster.start()
    try:
        run = subprocess.run(
            [sys.executable, "-c", DRIVER, cluster.address],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]
        pids = cluster.processes()
        listeners = _listeners(pids)
        assert listeners, "the cluster listens nowhere?"
        local = ("127.0.0.1:", "[::ffff:127.0.0.1]:")
        assert all(addr.startswith(local) for addr in listeners), listeners
        placement = {a["name"]: a["node_id"] for a in cluster.placement()}
        assert set(placement) == {"probe/0", "probe/1"}, placement
        assert placement["probe/0"] != placement["probe/1"], placement
    finally:
        cluster.stop()
    left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert left == [], left
    assert not cluster.temp_dir
