"""``--check``'s cheap checks of what a cluster run stands on, each one line naming key and fix.

Nothing is started: under ``scheduler.type=ray`` the address the trainer connects to
(``RAY_ADDRESS``, read by ``cua_rl/areal/ray_job.py``: AReaL's ``RayScheduler`` never calls
``ray.init`` itself) must be set and its port accept a TCP connection; under ``slurm``, ``sbatch``
must be on PATH (AReaL's ``SlurmScheduler`` submits each role with it). On either, the run's
shared paths must be absolute and not under ``/tmp``, since workers on other nodes resolve them on
their own file system. Whatever the scheduler, the policy's folder must hold a config.json and
weights: AReaL's workers would otherwise fail minutes later, each with its own traceback.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cua_rl.app.check_result import CheckResult

_WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def ray_address_check(environ: dict[str, str], *, timeout: float = 3.0) -> CheckResult:
    """RAY_ADDRESS set, and its GCS port accepts TCP (only that: Ray itself is not joined)."""
    address = environ.get("RAY_ADDRESS", "")
    if not address:
        return CheckResult(
            "ray", False,
            "scheduler.type=ray but RAY_ADDRESS is unset: set RAY_ADDRESS=<head>:6379, the "
            "address `ray start --head` printed (docs/cluster.md, Under Ray)",
        )  # fmt: skip
    if address in ("auto", "local"):
        # "auto" is looked up on this node by Ray, "local" would start a one-node cluster here.
        ok = address == "auto"
        fix = "" if ok else ": set RAY_ADDRESS=<head>:6379 to join the cluster instead"
        return CheckResult("ray", ok, f"RAY_ADDRESS={address}: not a host:port{fix}")
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        return CheckResult(
            "ray", False, f"RAY_ADDRESS={address!r} is not host:port: set it to <head>:6379"
        )
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return CheckResult(
            "ray", False,
            f"RAY_ADDRESS={address}: nothing accepts connections there ({exc}): start the head "
            "with `ray start --head --port=6379`, or fix RAY_ADDRESS",
        )  # fmt: skip
    return CheckResult("ray", True, f"RAY_ADDRESS={address}: the port accepts connections")


def sbatch_check(path: str | None = None) -> CheckResult:
    found = shutil.which("sbatch", path=path)
    if not found:
        return CheckResult(
            "slurm", False,
            "scheduler.type=slurm but sbatch is not on PATH: run the trainer on a node that "
            "submits Slurm jobs (a login node), or add Slurm's bin folder to PATH",
        )  # fmt: skip
    return CheckResult("slurm", True, f"sbatch: {found}")


def shared_paths(config: Any) -> list[tuple[str, str]]:
    """The (key, value) paths every node of a cluster run must resolve to the same place."""
    paths = [("cluster.fileroot", config.cluster.fileroot)]
    if config.cluster.name_resolve.type == "nfs":
        nr = config.cluster.name_resolve.nfs_record_root
        paths.append(("cluster.name_resolve.nfs_record_root", nr))
    if config.actor.path and Path(config.actor.path).exists():
        paths.append(("actor.path", config.actor.path))
    return paths


# The top folder every node has a private one of (AReaL's defaults put runs there).
NODE_LOCAL_TOP = "tmp"


def shared_paths_check(config: Any) -> CheckResult:
    scheduler = config.scheduler.type
    bad = []
    for key, value in shared_paths(config):
        if not Path(value).is_absolute():
            bad.append(f"{key}={value} is relative to this node's working folder")
        elif Path(value).parts[1:2] == (NODE_LOCAL_TOP,):
            bad.append(f"{key}={value} is under /{NODE_LOCAL_TOP}, which is each node's own")
    if bad:
        return CheckResult(
            "paths", False,
            f"scheduler.type={scheduler}: " + "; ".join(bad) + ": workers on other nodes "
            "would not see it: give absolute paths on storage every node mounts (under /storage "
            "for Slurm's image, docs/cluster.md)",
        )  # fmt: skip
    shown = ", ".join(f"{k}={v}" for k, v in shared_paths(config))
    return CheckResult("paths", True, f"absolute: {shown}")


def is_local_model(path: str) -> bool:
    """Whether ``path`` names a folder here rather than a hub id (``org/name``)."""
    return path.startswith(("/", ".", "~")) or Path(path).exists()


def model_folder_problem(path: str) -> str | None:
    """Why ``path`` is not a usable local checkpoint, or None. A hub id (``org/name``, no such
    folder here) is left to the workers, which download it."""
    if not is_local_model(path):
        return None
    p = Path(path).expanduser()
    if not p.is_dir():
        return f"actor.path={path}: no such folder"
    if not (p / "config.json").is_file():
        return f"actor.path={path}: no config.json (not a Hugging Face checkpoint folder)"
    if not any(next(p.glob(pattern), None) for pattern in _WEIGHTS):
        return f"actor.path={path}: config.json but no weights (*.safetensors or *.bin)"
    return None


def cluster_checks(config: Any, environ: dict[str, str]) -> list[CheckResult]:
    """The scheduler's lines: none for the local scheduler."""
    scheduler = config.scheduler.type
    if scheduler not in ("ray", "slurm"):
        return []
    first = ray_address_check(environ) if scheduler == "ray" else sbatch_check(environ.get("PATH"))
    return [first, shared_paths_check(config)]
