"""A single-node Slurm on this machine, on loopback only, for AReaL's Slurm scheduler.

Debian's ``slurm-wlm`` and ``munge``: a ``munged`` on its own socket, ``slurmctld`` and
``slurmd`` in the foreground (``-D``), all three started here in their own process groups with a
``slurm.conf`` written into a folder of this run. ``CommunicationParameters=NoCtldInAddrAny,
NoInAddrAny`` makes the daemons (and ``srun``) bind the node's address, 127.0.0.1, instead of
every interface. Clients find this controller through ``SLURM_CONF`` (``env()``), which the
trainer's ``sbatch`` calls inherit. ``stop()`` cancels every job of this controller, then ends
the daemons it started. Needs root (slurmd runs jobs as their users) and the Debian packages.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from cua_rl.errors import CuaRlError

DAEMONS = ("munged", "slurmctld", "slurmd")


class SlurmUnavailable(CuaRlError, RuntimeError):
    """The local Slurm could not start (missing packages, not root, a daemon failed)."""


def missing() -> str:
    """Why a local Slurm cannot start here, or '' when it can be tried."""
    absent = [d for d in (*DAEMONS, "sbatch", "squeue", "scancel") if not shutil.which(d)]
    if absent:
        return f"not installed: {', '.join(absent)} (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root"
    if not Path("/etc/munge/munge.key").exists():
        return "no /etc/munge/munge.key (the munge package creates it)"
    return ""


def _free_port() -> int:
    from cua_rl.serving import bind_free_port

    sock = bind_free_port()
    try:
        return sock.getsockname()[1]
    finally:
        sock.close()


class LocalSlurm:
    """``with LocalSlurm(folder, cpus=2, memory_mb=16000) as slurm: slurm.env()``."""

    def __init__(self, folder: Path, *, cpus: int = 2, memory_mb: int = 16000):
        self.folder = Path(folder)
        self.cpus, self.memory_mb = cpus, memory_mb
        self.conf = self.folder / "slurm.conf"
        self.socket = self.folder / "munge" / "munge.socket"
        self._procs: list[subprocess.Popen] = []

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        f = self.folder
        for sub in ("ctld", "d", "munge"):
            (f / sub).mkdir(parents=True, exist_ok=True)
        shutil.chown(f / "munge", "munge", "munge")
        f.chmod(0o755)
        lines = [
            "ClusterName=cuarl",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.socket}",
            "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",
            f"StateSaveLocation={f / 'ctld'}",
            f"SlurmdSpoolDir={f / 'd'}",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'slurmd.pid'}",
            f"SlurmctldLogFile={f / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'slurmd.log'}",
            # No cgroup setup on this machine: track and bind nothing.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "MpiDefault=none",
            "ReturnToService=2",
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} "
            f"RealMemory={self.memory_mb} State=UNKNOWN",
            "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.folder / f"{name}.out", "wb")  # noqa: SIM115 - the child holds it
        self._procs.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        log.close()

    def start(self, timeout: float = 60.0) -> LocalSlurm:
        why = missing()
        if why:
            raise SlurmUnavailable(why)
        self._write_conf()
        m = self.folder / "munge"
        self._spawn(
            "munged",
            ["munged", "-F", f"--socket={self.socket}", f"--pid-file={m / 'munged.pid'}",
             f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'seed'}", "-f"],
        )  # fmt: skip
        try:
            self._wait(lambda: self.socket.exists(), timeout, "munged")
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
            self._wait(self._node_idle, timeout, "slurmctld/slurmd")
        except BaseException:
            self.stop()
            raise
        return self

    def _node_idle(self) -> bool:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=self._env()
        )
        return out.returncode == 0 and out.stdout.strip() == "idle"

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.env()}

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in self._procs if p.poll() is not None]
            if dead:
                raise SlurmUnavailable(f"{', '.join(dead)} exited; logs in {self.folder}")
            if ready():
                return
            time.sleep(0.3)
        raise SlurmUnavailable(f"{what} not ready within {timeout}s; logs in {self.folder}")

    def jobs(self) -> list[str]:
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, env=self._env()
        )
        return [line for line in out.stdout.splitlines() if line.strip()]

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every job of this controller (AReaL leaves its worker jobs running when a
        training fails to start), wait for them to end, then stop the daemons."""
        if self._procs and all(p.poll() is None for p in self._procs[1:]):
            subprocess.run(["scancel", "--full", "-p", "debug"], env=self._env(), check=False)
            deadline = time.monotonic() + timeout
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
        for proc in reversed(self._procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)
        self._procs.clear()

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
