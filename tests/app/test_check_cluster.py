"""``--check``'s cluster lines: the Ray address, sbatch on PATH, shared paths, the model folder.

Each case is built for real: RAY_ADDRESS at a refused port and at a listening one, an executable
``sbatch`` in a folder put on PATH, model folders in tmp dirs. Neither Ray nor Slurm is started.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from cua_rl.app import train
from cua_rl.app.check_cluster import (
    NODE_LOCAL_TOP,
    cluster_checks,
    model_folder_problem,
    ray_address_check,
    sbatch_check,
    shared_paths_check,
)
from cua_rl.app.train import load_config
from cua_rl.serving import bind_free_port

ROOT = Path(__file__).resolve().parents[2]
CUA = str(ROOT / "configs" / "cua.yaml")
SERVICES = [
    "gym.base_url=http://gym:8800", "gym.gym_id=android-world", "agent.base_url=http://agent:3000",
    "monitor.base_url=http://monitor:8000",
]  # fmt: skip
SHARED = [
    "cluster.fileroot=/storage/runs/cua",
    "cluster.name_resolve.nfs_record_root=/storage/runs/cua/name_resolve",
]
SLURM = [
    "scheduler.type=slurm", "cluster.n_nodes=2", "cluster.n_gpus_per_node=8",
    "actor.backend=fsdp:d8", "rollout.backend=vllm:d8",
]  # fmt: skip


def _cua(*overrides):
    return load_config(["--config", CUA, "actor.path=/models/absent", *SERVICES, *overrides])


def _model(parent, *files):
    folder = parent / "model"
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_text(json.dumps({"model_type": "qwen2_vl"}))
    return str(folder)


def test_ray_address_unset_is_named():
    result = ray_address_check({})
    assert not result.ok and "RAY_ADDRESS is unset" in result.detail
    assert "RAY_ADDRESS=<head>:6379" in result.detail


def test_ray_address_refused_and_listening():
    refused = bind_free_port()  # bound, never listening: connections are refused
    port = refused.getsockname()[1]
    result = ray_address_check({"RAY_ADDRESS": f"127.0.0.1:{port}"})
    refused.close()
    assert not result.ok and "nothing accepts connections" in result.detail
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        port = listening.getsockname()[1]
        assert ray_address_check({"RAY_ADDRESS": f"127.0.0.1:{port}"}).ok
        assert ray_address_check({"RAY_ADDRESS": f"ray://127.0.0.1:{port}"}).ok


@pytest.mark.parametrize("address", ["local", "head-without-port", "http://:80"])
def test_ray_address_that_does_not_name_a_head(address):
    assert not ray_address_check({"RAY_ADDRESS": address}).ok


def test_sbatch_absent_and_present(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = sbatch_check(str(empty))
    assert not missing.ok and "sbatch is not on PATH" in missing.detail
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'Submitted batch job 1'\n")
    sbatch.chmod(0o755)
    found = sbatch_check(f"{empty}:{bin_dir}")
    assert found.ok and str(sbatch) in found.detail


def test_relative_and_tmp_paths_refused_on_a_cluster():
    # cua.yaml's own ./runs/cua and AReaL's /tmp default are per node.
    node_local = f"/{NODE_LOCAL_TOP}/nr"  # a folder each node has its own of
    config = _cua("scheduler.type=ray", f"cluster.name_resolve.nfs_record_root={node_local}")
    result = shared_paths_check(config)
    assert not result.ok
    assert "cluster.fileroot=./runs/cua is relative" in result.detail
    want = f"cluster.name_resolve.nfs_record_root={node_local} is under /{NODE_LOCAL_TOP}"
    assert want in result.detail
    assert shared_paths_check(_cua("scheduler.type=ray", *SHARED)).ok


def test_the_local_scheduler_gets_no_cluster_lines():
    assert cluster_checks(_cua(), {}) == []
    names = [r.name for r in cluster_checks(_cua("scheduler.type=ray", *SHARED), {})]
    assert names == ["ray", "paths"]


def test_model_folder_problems(tmp_path):
    assert "no such folder" in model_folder_problem(str(tmp_path / "absent"))
    assert "no config.json" in model_folder_problem(_model(tmp_path / "empty"))
    assert "no weights" in model_folder_problem(_model(tmp_path / "config", "config.json"))
    complete = _model(tmp_path / "complete", "config.json", "model.safetensors")
    assert model_folder_problem(complete) is None
    # A hub id is not a folder here; the workers download it.
    assert model_folder_problem("Qwen/Qwen3-VL-8B-Instruct") is None


def test_check_prints_the_slurm_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere
    rc = train.main(
        # A hub id: a local folder that is not a checkpoint is a config error (exit 2) before
        # these lines (tests/app/test_launch_errors.py).
        ["--config", CUA, "--check", *SERVICES, *SLURM, "actor.path=Qwen/Qwen3-VL-8B-Instruct"]
    )
    out = capsys.readouterr().out
    assert rc == 1
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("FAIL")}
    assert "sbatch is not on PATH" in lines["slurm"]
    assert "cluster.fileroot=./runs/cua is relative" in lines["paths"]
    (model,) = [line for line in out.splitlines() if line.split()[1:2] == ["model"]]
    assert model.startswith("skip") and "is a hub id" in model
