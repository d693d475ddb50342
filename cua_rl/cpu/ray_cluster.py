"""A Ray cluster of several nodes on this machine, listening on loopback only.

``ray start`` turns ``--node-ip-address=127.0.0.1`` into the machine's outward address
(``ray._private.services.resolve_ip_for_localhost``), and Ray's GCS and raylets listen on every
interface unless their node address is exactly ``127.0.0.1`` (then they listen on 127.0.0.1
only). A driver connecting to ``127.0.0.1:port`` is redirected the same way. So every process
that takes part (each node's ``ray start`` and the driver) keeps a loopback address as given:
``keep_loopback()``. Nodes then share the address 127.0.0.1 and are told apart by node id, as
Ray's own multi-node tests on one machine do.

``python -m cua_rl.cpu.ray_cluster ARGS`` is ``ray ARGS`` with that one change.
``LocalRayCluster`` starts a head and further nodes with ``ray start --block``, each in its own
process group, and stops exactly the processes it started (the nodes and every process they
spawned, Ray's workers included: raylets put workers in their own process groups).

On a loaded machine a node's start can fail for want of CPU, in two ways, neither configurable in
Ray 2.60: its raylet waits a fixed 15 s for its dashboard agent (a Python process) to write its
port files and aborts ("Check failed ... Timed out waiting for file .../metrics_agent_port_..."),
and ``ray start`` waits a fixed 30 s for its raylet to register with the GCS ("The current node
timed out during startup"). ``RAY_agent_register_timeout_ms`` does not reach the first (tried:
the raylet still aborts at 15 s). So a ``ray start`` that exits before its node runs starts the
whole cluster again, up to ``attempts`` times: each failure is logged with its node's last lines
and its logs (Ray's session logs included) are kept under ``log_dir/failed-start-N/``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cua_rl.errors import CuaRlError

LOOPBACK = "127.0.0.1"
STARTED = "Ray runtime started."  # what `ray start` prints once its node runs

logger = logging.getLogger(__name__)


class RayClusterError(CuaRlError, RuntimeError):
    """The local Ray cluster did not start."""


def _raylet_abort(kept: Path) -> str:
    """A raylet's own reason for stopping, from the session logs kept of a failed start."""
    for log in sorted(kept.glob("ray-session-logs/raylet*.out")):
        for line in log.read_text(errors="replace").splitlines():
            if "Check failed" in line:
                return f"; {log.name}: ...{line[line.index('Check failed') :][:300]}"
    return ""


class RayNodeExited(RayClusterError):
    """A ``ray start`` exited before its node ran (the cluster may start on another attempt)."""


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def keep_loopback() -> None:
    """Make Ray keep a loopback address as given in this process (idempotent)."""
    from ray._private import services

    def resolve_ip_for_localhost(host: str) -> str:
        if not host:
            raise ValueError(f"Malformed host: {host}")
        return host

    services.resolve_ip_for_localhost = resolve_ip_for_localhost


def _free_port() -> int:
    from cua_rl.serving import bind_free_port

    sock = bind_free_port(LOOPBACK)
    try:
        return sock.getsockname()[1]
    finally:
        sock.close()


class LocalRayCluster:
    """``with LocalRayCluster(log_dir, nodes=2) as cluster: cluster.address``."""

    def __init__(
        self,
        log_dir: Path,
        *,
        nodes: int = 2,
        cpus_per_node: int = 1,
        python: str = sys.executable,
        start_timeout: float = 120.0,
        attempts: int = 8,
    ):
        if nodes < 1 or cpus_per_node < 1:
            raise ValueError("a cluster needs at least one node with at least one CPU")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.log_dir = Path(log_dir)
        self.nodes, self.cpus_per_node = nodes, cpus_per_node
        self.python, self.start_timeout, self.attempts = python, start_timeout, attempts
        self.address = ""
        # One line per start that failed and was retried: what the node printed last.
        self.failed_starts: list[str] = []
        self.started_in_s = self.stopped_in_s = 0.0
        self._procs: list[subprocess.Popen] = []
        self._logs: list = []
        # Ray's unix sockets live under its temp dir; a short system path keeps them under the
        # 107-byte limit of a socket path.
        self.temp_dir = ""

    def _ray_start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"ray-{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        argv = [self.python, "-m", "cua_rl.cpu.ray_cluster", "start", "--block", *args]
        common = [
            f"--node-ip-address={LOOPBACK}",
            f"--num-cpus={self.cpus_per_node}",
            "--num-gpus=0",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        proc = subprocess.Popen(
            [*argv, *common],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        self._procs.append(proc)
        return proc

    def start(self) -> LocalRayCluster:
        t0 = time.monotonic()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, self.attempts + 1):
            try:
                self._start_once()
                break
            except RayNodeExited as exc:
                kept = self.log_dir / f"failed-start-{attempt}"
                self.stop(keep_logs_in=kept)
                failure = f"{exc}{_raylet_abort(kept)}"
                if attempt == self.attempts:
                    raise RayNodeExited(
                        f"{failure}\n(the cluster's start failed {attempt} times; the logs of "
                        f"each are under {self.log_dir}/failed-start-N)"
                    ) from None
                self.failed_starts.append(f"{failure} (logs kept in {kept})")
                logger.warning(
                    "Ray cluster start %d of %d failed, starting again: %s",
                    attempt,
                    self.attempts,
                    self.failed_starts[-1],
                )
            except BaseException:
                self.stop(keep_logs_in=self.log_dir / "failed-start")
                raise
        self.started_in_s = time.monotonic() - t0
        return self

    def _start_once(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="cua-ray-")
        port = _free_port()
        self.address = f"{LOOPBACK}:{port}"
        self._ray_start("head", ["--head", f"--port={port}", "--include-dashboard=false"])
        self._wait_started()
        for i in range(1, self.nodes):
            self._ray_start(f"node{i}", [f"--address={self.address}"])
        self._wait_started()
        self._check_alive_nodes()

    def _wait_started(self) -> None:
        """Until every ``ray start`` so far has printed that its node runs."""
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            dead = [
                (p, log)
                for p, log in zip(self._procs, self._logs, strict=True)
                if p.poll() is not None
            ]
            if dead:
                said = "; ".join(
                    f"{Path(log.name).name} exited {p.returncode}: {_tail(Path(log.name))}"
                    for p, log in dead
                )
                raise RayNodeExited(f"ray start exited before its node ran: {said}")
            logs = [Path(log.name).read_text(errors="replace") for log in self._logs]
            if all(STARTED in text for text in logs):
                return
            time.sleep(0.2)
        raise RayClusterError(f"Ray nodes not started in {self.start_timeout}s: {self.log_dir}")

    def _check_alive_nodes(self) -> None:
        """The GCS, asked by a short-lived driver, counts every node alive."""
        probe = (
            "import sys; from cua_rl.cpu.ray_cluster import alive_nodes as a; print(a(sys.argv[1]))"
        )
        out = subprocess.run(
            [self.python, "-c", probe, self.address],
            capture_output=True,
            text=True,
            timeout=self.start_timeout,
        )
        alive = int(out.stdout.split()[-1]) if out.returncode == 0 and out.stdout else 0
        if alive != self.nodes:
            raise RayClusterError(
                f"{alive} of {self.nodes} Ray nodes alive at {self.address}: {out.stderr[-2000:]}"
            )

    def placement(self) -> list[dict]:
        """``actor_placement`` of this cluster, asked by a short-lived driver process."""
        import json

        probe = (
            "import json, sys; from cua_rl.cpu.ray_cluster import actor_placement as a; "
            "print(json.dumps(a(sys.argv[1])))"
        )
        out = subprocess.run(
            [self.python, "-c", probe, self.address], capture_output=True, text=True, timeout=120
        )
        if out.returncode != 0:
            raise RayClusterError(f"could not read the actor table: {out.stderr[-2000:]}")
        return json.loads(out.stdout.splitlines()[-1])

    def processes(self) -> list[int]:
        """Every live process the cluster consists of: the nodes and all they spawned."""
        import psutil

        pids = []
        for proc in self._procs:
            try:
                root = psutil.Process(proc.pid)
                pids += [root.pid, *(c.pid for c in root.children(recursive=True))]
            except psutil.NoSuchProcess:
                continue
        return pids

    def stop(self, timeout: float = 20.0, keep_logs_in: Path | None = None) -> None:
        """SIGTERM to every process of the cluster, SIGKILL to those left after ``timeout``.
        ``keep_logs_in``: move the nodes' logs and Ray's session logs there first (a failed
        start: Ray's own logs live in the temporary folder this removes)."""
        import psutil

        t0 = time.monotonic()
        # A node's `ray start` that died may have left processes in its group (its parent gone,
        # processes() cannot find them).
        for proc in self._procs:
            if proc.poll() is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

        procs = []
        for pid in self.processes():
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        for proc in self._procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        for log in self._logs:
            log.close()
            if keep_logs_in is not None:
                keep_logs_in.mkdir(parents=True, exist_ok=True)
                shutil.move(log.name, keep_logs_in / Path(log.name).name)
        self._logs.clear()
        session_logs = Path(self.temp_dir, "session_latest", "logs") if self.temp_dir else None
        if keep_logs_in is not None and session_logs and session_logs.is_dir():
            try:
                shutil.copytree(session_logs, keep_logs_in / "ray-session-logs", dirs_exist_ok=True)
            except (OSError, shutil.Error) as exc:
                logger.warning("Ray's session logs not kept in %s: %s", keep_logs_in, exc)
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = ""
        self.stopped_in_s = time.monotonic() - t0

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _driver(address: str):
    keep_loopback()
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    return ray


def alive_nodes(address: str) -> int:
    """Number of alive nodes of the cluster at ``address`` (a driver connects and leaves)."""
    ray = _driver(address)
    try:
        return sum(1 for n in ray.nodes() if n["Alive"])
    finally:
        ray.shutdown()


def actor_placement(address: str) -> list[dict]:
    """Every named actor the cluster has run (alive or not) and the node it ran on, from the
    GCS's actor table. (Ray's ``ray.util.state`` API reads the same table through the
    dashboard, which this cluster does not start: it needs ``ray[default]``.)"""
    ray = _driver(address)
    try:
        from ray._private import state

        return [
            {"name": a["Name"], "node_id": a["Address"]["NodeID"], "state": a["State"]}
            for a in state.actors().values()
            if a.get("Name")
        ]
    finally:
        ray.shutdown()


def main(argv: list[str]) -> None:
    keep_loopback()
    from ray.scripts.scripts import main as ray_main

    sys.argv = ["ray", *argv]
    ray_main()


if __name__ == "__main__":
    main(sys.argv[1:])
