"""The local Ray cluster itself: two nodes, loopback only, and nothing left once stopped.

Real ``ray start`` processes; the driver is this test process's child (a short-lived Python),
as train.py would be. Every listening socket of every process of the cluster is read from the
kernel (``ss``) and must be on 127.0.0.1.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


# What a `ray start` that exits before its node runs looks like to the cluster (on a loaded
# machine: "The current node timed out during startup"): the second node's first start fails.
FAILING_ONCE = """#!/bin/sh
case "$*" in
*--address=*) if mkdir "$0.failed" 2>/dev/null; then echo "injected: this start fails"; exit 3; fi;;
esac
exec {python} "$@"
"""


def _session_dir(head_log: Path) -> str:
    """The Ray temporary folder a head's `ray start` log names."""
    match = re.search(r"saved to: (/\S+?)/session_", head_log.read_text())
    assert match, head_log.read_text()[-2000:]
    return match.group(1)


def test_two_nodes_on_loopback_spread_actors_and_stop_completely(tmp_path):
    """And a node whose first start fails: the cluster starts again, keeps the failed start's
    logs, and leaves none of its processes."""
    python = tmp_path / "python-failing-once"
    python.write_text(FAILING_ONCE.format(python=sys.executable))
    python.chmod(0o755)
    cluster = LocalRayCluster(tmp_path / "logs", nodes=2, cpus_per_node=1, python=str(python))
    cluster.start()
    try:
        # A loaded machine may fail starts of its own (the module's docstring), before or after.
        (injected,) = [f for f in cluster.failed_starts if "injected" in f]
        assert "ray-node1.log exited 3: injected: this start fails" in injected
        (kept,) = [
            p.parent
            for p in (tmp_path / "logs").glob("failed-start-*/ray-node1.log")
            if "injected" in p.read_text()
        ]
        assert f"logs kept in {kept}" in injected
        # Ray's own logs of the failed start's head, copied before its folder went.
        assert any((kept / "ray-session-logs").glob("gcs_server*")), list(kept.rglob("*"))
        first = _session_dir(kept / "ray-head.log")
        assert first != cluster.temp_dir and not Path(first).exists()
        left = [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if first in " ".join(p.info["cmdline"] or [])
        ]
        assert left == [], left
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
