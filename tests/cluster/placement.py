"""What AReaL's own controllers and schedulers would allocate for a config, without a cluster.

AReaL's ``TrainController`` and ``RolloutController`` build each role's ``Job`` (replicas and
``SchedulingSpec`` per worker) and hand it to the scheduler's ``create_workers``; ``Stop`` is a
scheduler that takes that Job, optionally passes it on to a real scheduler, and then stops the
controller before it waits for workers. The placement is then read from each real scheduler:
the local one's round-robin ``_allocate_gpus`` (what becomes CUDA_VISIBLE_DEVICES), Ray's
placement strategies' bundles, and the ``sbatch`` script the Slurm scheduler writes (submitted
to a stand-in ``sbatch`` on PATH that only answers a job id).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from areal.infra.controller.rollout_controller import RolloutController
from areal.infra.controller.train_controller import TrainController

from cua_rl.app.placement import placed_roles


class Created(Exception):
    """Raised by ``Stop`` once the controller has asked for its workers."""

    def __init__(self, job, worker_ids):
        super().__init__(job.role)
        self.job, self.worker_ids = job, worker_ids


class Stop:
    """A scheduler that records the Job (after the real ``inner`` created it, if any)."""

    def __init__(self, inner=None):
        self.inner = inner

    def create_workers(self, job, *args, **kwargs):
        ids = self.inner.create_workers(job) if self.inner is not None else None
        raise Created(job, ids)


def jobs(config, inner=None) -> list:
    """Each separately placed role's Job, in PPOTrainer's order, as AReaL's controllers build it."""
    out = []
    for name, section in placed_roles(config):
        scheduler = Stop(inner)
        try:
            if name == "rollout":
                RolloutController(None, section, scheduler).initialize(role=name)
            else:
                TrainController(None, section, scheduler).initialize(role=name, ft_spec=None)
        except Created as created:
            out.append(created.job)
        else:
            raise AssertionError(f"{name}: the controller never asked for workers")
    return out


def local_gpus(config, n_gpus: int, tmp_path: Path) -> dict[str, list[list[int]]]:
    """CUDA_VISIBLE_DEVICES per worker, from AReaL's LocalScheduler on a machine of n_gpus."""
    from areal.infra.scheduler.local import LocalScheduler

    sched = LocalScheduler(
        gpu_devices=list(range(n_gpus)),
        log_dir=str(tmp_path / "logs"),
        experiment_name=config.experiment_name,
        trial_name=config.trial_name,
        fileroot=str(tmp_path),
        nfs_record_root=str(tmp_path),
    )
    out = {}
    for job in jobs(config):
        specs = sched._prepare_worker_specs(job.role, job.replicas, job.tasks)
        out[job.role] = [sched._allocate_gpus(spec.gpu) for spec in specs]
    return out


def ray_bundles(config, monkeypatch) -> dict[str, list[dict]]:
    """The placement-group bundles AReaL's Ray strategies would reserve, as on a GPU node
    (their device type comes from torch.cuda in the trainer, which has none here)."""
    from areal.infra.scheduler.ray import RayScheduler
    from areal.infra.utils import ray_placement_group as rpg

    monkeypatch.setattr(rpg, "ray_resource_type", lambda: "GPU")
    sched = RayScheduler(exp_config=config)
    out = {}
    for job in jobs(config):
        specs = sched._prepare_worker_specs(job.role, job.replicas, job.tasks)
        strategy = sched._get_placement_strategy(specs)
        if isinstance(strategy, rpg.SharedRayPlacementStrategy):
            # SharedRayPlacementStrategy.create_placement_group: one bundle per worker.
            out[job.role] = [rpg._bundle_spec(s.cpu, s.gpu, s.mem) for s in specs]
        else:
            out[job.role] = [
                b for s in specs for b in strategy._create_bundles(s, sched.n_gpus_per_node)
            ]
    return out


def fake_sbatch(bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "sbatch"
    script.write_text('#!/bin/sh\necho "Submitted batch job 4242"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def slurm_scripts(config, tmp_path: Path, monkeypatch) -> dict[str, dict]:
    """Per role, what AReaL's SlurmScheduler.create_workers submits: nodes, tasks per node, the
    --gres and the CUDA_VISIBLE_DEVICES line of the sbatch script it wrote."""
    from areal.infra.scheduler.slurm import SlurmScheduler

    fake_sbatch(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    sched = SlurmScheduler(exp_config=config)
    out = {}
    for job in jobs(config, inner=sched):
        text = Path(sched._sbatch_path_of(job.role)).read_text()
        opt = dict(re.findall(r"#SBATCH --([\w-]+)=(\S+)", text))
        cuda = re.search(r"export CUDA_VISIBLE_DEVICES=([^;\n]+)", text)
        out[job.role] = {
            "nodes": int(opt["nodes"]),
            "tasks_per_node": int(opt["ntasks-per-node"]),
            "gres": opt.get("gres"),
            "cuda": cuda.group(1) if cuda else None,
            "image": re.search(r"singularity exec .* (/\S+\.sif) ", text).group(1),
        }
    return out
