"""configs/cua.yaml asks each scheduler for the GPUs its backend strings imply, as AReaL's own
controllers and schedulers compute them (tests/cluster/placement.py), and a split a scheduler
cannot place is refused at load with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from areal.api.cli_args import load_expr_config

from cua_rl.app.config import CUAConfig
from cua_rl.app.placement import role_gpus
from cua_rl.errors import ConfigError
from tests.cluster import placement

ROOT = Path(__file__).resolve().parents[2]
PROD = ROOT / "configs" / "cua.yaml"
REQUIRED = [
    "actor.path=/models/policy",
    "gym.base_url=http://gym:8800",
    "gym.gym_id=android-world",
    "agent.base_url=http://agent:3000",
    "monitor.base_url=http://monitor:8000",
]
TWO_NODES = ["cluster.n_nodes=2", "actor.backend=fsdp:d8", "rollout.backend=vllm:d8"]


def load(tmp_path: Path, *overrides: str) -> CUAConfig:
    (tmp_path / "nr").mkdir(parents=True, exist_ok=True)
    argv = ["--config", str(PROD), f"cluster.fileroot={tmp_path}"]
    argv += [f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}", *REQUIRED, *overrides]
    return load_expr_config(argv, CUAConfig)[0]


def test_one_node_local_gives_each_worker_its_own_gpu(tmp_path):
    cfg = load(tmp_path)
    got = placement.local_gpus(cfg, 8, tmp_path)
    # fsdp:d4 and vllm:d4: four ranks, four single-GPU servers, eight distinct GPUs.
    assert got == {"actor": [[0], [1], [2], [3]], "rollout": [[4], [5], [6], [7]]}
    assert {r.role: r.total for r in role_gpus(cfg)} == {"actor": 4, "rollout": 4}


def test_without_scheduling_spec_areal_gives_no_gpu(tmp_path):
    """AReaL's default spec (gpu 0) is what cua.yaml used to get: the check refuses it."""
    with pytest.raises(ConfigError, match=r"actor.scheduling_spec\[0\].gpu=1"):
        load(tmp_path, "actor.scheduling_spec=[{cmd: 'python -m areal.infra.rpc.rpc_server'}]")
    cfg = load(tmp_path, "actor.scheduling_spec=[{gpu: 0}]", "cpu=true")
    assert placement.local_gpus(cfg, 8, tmp_path)["actor"] == [[], [], [], []]


def test_tensor_parallel_servers_get_tp_gpus_each(tmp_path):
    cfg = load(tmp_path, "rollout.backend=vllm:d2t2")
    got = placement.local_gpus(cfg, 8, tmp_path)
    assert got["rollout"] == [[4, 5], [6, 7]]
    assert [r.gpus_per_worker for r in role_gpus(cfg)] == [1, 2]


def test_more_gpus_than_the_node_is_refused_not_shared(tmp_path):
    """AReaL's local scheduler would wrap around and put two workers on one GPU."""
    cfg = load(tmp_path, "cpu=true", "rollout.backend=vllm:d8")
    assert placement.local_gpus(cfg, 8, tmp_path)["rollout"][4:] == [[0], [1], [2], [3]]
    with pytest.raises(ConfigError, match="ask for 12 GPUs .* = 8"):
        load(tmp_path, "rollout.backend=vllm:d8")


def test_two_node_ray_bundles_match_the_backend_strings(tmp_path, monkeypatch):
    cfg = load(tmp_path, "scheduler.type=ray", *TWO_NODES)
    bundles = placement.ray_bundles(cfg, monkeypatch)
    gpus = {role: [b.get("GPU", 0.0) for b in bs] for role, bs in bundles.items()}
    assert gpus == {"actor": [1.0] * 8, "rollout": [1.0] * 8}
    assert sum(map(sum, gpus.values())) == 2 * cfg.cluster.n_gpus_per_node


def test_two_node_slurm_gives_each_role_a_whole_node(tmp_path, monkeypatch):
    cfg = load(tmp_path, "scheduler.type=slurm", *TWO_NODES)
    got = placement.slurm_scripts(cfg, tmp_path, monkeypatch)
    for role in ("actor", "rollout"):
        assert got[role]["nodes"] == 1 and got[role]["tasks_per_node"] == 8
        assert got[role]["gres"] == "gpu:8"
        assert got[role]["cuda"] == "$((SLURM_LOCALID * 1))"  # one GPU per task
        assert got[role]["image"].startswith("/storage/")  # AReaL binds only /storage


def test_the_documented_one_node_split_is_refused_on_slurm_with_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="entire nodes.*fsdp:d8 rollout.backend=vllm:d8"):
        load(tmp_path, "scheduler.type=slurm")
    # AReaL's own scheduler refuses the same split when it writes the sbatch script.
    cfg = load(tmp_path, "cpu=true")
    cfg.scheduler.type = "slurm"
    with pytest.raises(ValueError, match="Slurm only supports allocating entire nodes"):
        placement.slurm_scripts(cfg, tmp_path, monkeypatch)


@pytest.mark.parametrize(
    "actor,rollout", [(4, 4), (8, 8), (16, 8), (8, 4), (2, 6), (8, 16), (24, 8)]
)
def test_our_slurm_check_agrees_with_arealss_scheduler(tmp_path, monkeypatch, actor, rollout):
    split = [f"actor.backend=fsdp:d{actor}", f"rollout.backend=vllm:d{rollout}"]
    shape = ["scheduler.type=slurm", "cluster.n_nodes=4", *split]
    try:
        load(tmp_path, *shape)
        ours = None
    except ConfigError as exc:
        ours = str(exc)
    cfg = load(tmp_path / "x", "cpu=true", "cluster.n_nodes=4", *split)
    cfg.scheduler.type = "slurm"
    try:
        placement.slurm_scripts(cfg, tmp_path / "x", monkeypatch)
        theirs = None
    except ValueError as exc:
        theirs = str(exc)
    assert (ours is None) == (theirs is None), (ours, theirs)
