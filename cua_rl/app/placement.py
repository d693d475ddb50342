"""The GPUs a config asks AReaL for, and whether its scheduler can place them, checked at load.

The backend strings set the GPU count, not ``cluster.n_nodes``: ``actor.backend: fsdp:d4``
makes 4 training workers (AReaL's ``TrainController``: one worker per rank, each given
``scheduling_spec[0].gpu`` GPUs), ``rollout.backend: vllm:d4t2`` makes 4 inference servers of
tp x pp = 2 GPUs (``RolloutController``: ``gpu`` there only says whether a server gets GPUs at
all). ``scheduling_spec[0].gpu`` defaults to 0 in AReaL, and 0 means no GPU on every scheduler
(an empty CUDA_VISIBLE_DEVICES, Ray bundles without GPUs, no ``--gres``), so a GPU config must
set it. Then each scheduler places the workers its own way: the local one hands out the
machine's GPUs round-robin (wrapping around silently when asked for more), Ray reserves one
bundle per worker, Slurm submits one ``sbatch`` job per role that must take whole nodes
(``SlurmScheduler._generate_sbatch_script``: "Slurm only supports allocating entire nodes").
``check_placement`` refuses, with the fix, what would fail there or share GPUs by accident; the
tests compare its arithmetic with AReaL's scheduler code for the documented cluster shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cua_rl.errors import ConfigError

TRAIN_BACKENDS = ("fsdp", "megatron", "archon")
INFERENCE_BACKENDS = ("vllm", "sglang")


@dataclass(frozen=True)
class RoleGpus:
    """One role's workers as AReaL's controller creates them."""

    role: str
    backend: str  # the role's backend string, e.g. "vllm:d4"
    workers: int
    gpus_per_worker: int  # what the scheduler is asked for per worker
    needed_per_worker: int  # what the backend string implies per worker

    @property
    def total(self) -> int:
        return self.workers * self.gpus_per_worker

    @property
    def needed(self) -> int:
        return self.workers * self.needed_per_worker


def placed_roles(config: Any) -> list[tuple[str, Any]]:
    """The roles PPOTrainer creates workers for, in its order (the local scheduler's
    round-robin follows it); a role colocated with another takes no GPUs of its own."""
    roles = [("actor", config.actor)]
    if getattr(config, "critic", None) is not None:
        roles.append(("critic", config.critic))
    if config.actor.kl_ctl > 0 and getattr(config, "ref", None) is not None:
        roles.append(("ref", config.ref))
    roles.append(("rollout", config.rollout))
    return [
        (name, section)
        for name, section in roles
        if getattr(section.scheduling_strategy, "type", "separation") != "colocation"
    ]


def role_gpus(config: Any) -> list[RoleGpus]:
    """Per role: workers and GPUs per worker, by AReaL 1.0.4's controllers' rules."""
    from areal.api.alloc_mode import ModelAllocation

    out = []
    for name, section in placed_roles(config):
        alloc = ModelAllocation.from_str(section.backend, name=name)
        spec_gpu = section.scheduling_spec[0].gpu
        if name == "rollout":
            # RolloutController.initialize: one worker per server, gpu = tp * pp when gpu > 0.
            size = alloc.parallel.tp_size * alloc.parallel.pp_size
            workers, given = alloc.parallel.dp_size, (size if spec_gpu > 0 else 0)
            needed = size if alloc.backend in INFERENCE_BACKENDS else 0
        else:
            # TrainController.initialize: one worker per rank, each given scheduling_spec's gpu.
            workers, given = alloc.parallel.world_size, spec_gpu
            needed = 1 if alloc.backend in TRAIN_BACKENDS else 0
        out.append(RoleGpus(name, section.backend, workers, given, needed))
    return out


def check_placement(config: Any) -> list[RoleGpus]:
    """Refuse a GPU config its scheduler cannot place as its backend strings say."""
    roles = role_gpus(config)
    for r in roles:
        if r.needed_per_worker and not r.gpus_per_worker:
            raise ConfigError(
                f"{r.role}.backend={r.backend!r} runs on {r.needed} GPUs but "
                f"{r.role}.scheduling_spec[0].gpu is 0 (AReaL's default), so its workers would "
                f"get none: set {r.role}.scheduling_spec[0].gpu=1 (configs/cua.yaml does), or "
                "cpu=true for the CPU harness"
            )
        if r.role != "rollout" and r.gpus_per_worker > 1:
            raise ConfigError(
                f"{r.role}.scheduling_spec[0].gpu={r.gpus_per_worker}: each {r.backend} rank is "
                "one process on one GPU, so the extra GPUs would sit idle: set it to 1 and "
                f"raise the d in {r.role}.backend instead"
            )
    _check_capacity(config, roles)
    if config.scheduler.type == "slurm":
        _check_whole_nodes(config, roles)
    return roles


def _shape(config: Any) -> tuple[int, int]:
    return config.cluster.n_nodes, config.cluster.n_gpus_per_node


def _check_capacity(config: Any, roles: list[RoleGpus]) -> None:
    n_nodes, per_node = _shape(config)
    asked = " + ".join(f"{r.role} {r.backend} {r.total}" for r in roles)
    total = sum(r.total for r in roles)
    for r in roles:
        if r.gpus_per_worker > per_node:
            raise ConfigError(
                f"one {r.role} worker of {r.backend!r} needs {r.gpus_per_worker} GPUs but a node "
                f"has cluster.n_gpus_per_node={per_node}: lower its tensor/pipeline parallel size "
                "(t/p in the backend string) to fit one node"
            )
    if config.scheduler.type == "local" and n_nodes != 1:
        raise ConfigError(
            f"scheduler.type=local runs every worker on this machine, but cluster.n_nodes="
            f"{n_nodes}: set cluster.n_nodes=1, or scheduler.type=ray / slurm (docs/cluster.md)"
        )
    if total > n_nodes * per_node:
        raise ConfigError(
            f"the backend strings ask for {total} GPUs ({asked}) but the cluster has "
            f"cluster.n_nodes={n_nodes} x cluster.n_gpus_per_node={per_node} = "
            f"{n_nodes * per_node}: lower the d in actor.backend / rollout.backend (they set the "
            "GPU count), or describe the cluster you have in cluster.n_nodes"
        )


def _check_whole_nodes(config: Any, roles: list[RoleGpus]) -> None:
    """AReaL's Slurm scheduler gives each role's job whole nodes (``--gres=gpu:<per node>``
    on ceil(total / per node) nodes) and refuses a role whose GPUs are not a multiple of a node."""
    _, per_node = _shape(config)
    for r in roles:
        if r.total % per_node:
            raise ConfigError(
                f"scheduler.type=slurm: {r.role}.backend={r.backend!r} takes {r.total} GPUs, "
                f"not a multiple of cluster.n_gpus_per_node={per_node}, and AReaL's Slurm "
                "scheduler only allocates entire nodes to a role: give each role whole nodes, "
                f"e.g. actor.backend=fsdp:d{per_node} rollout.backend=vllm:d{per_node} "
                "cluster.n_nodes=2 (docs/cluster.md)"
            )


def describe(roles: list[RoleGpus]) -> str:
    """One line: what each role is given, for --check."""
    return "; ".join(f"{r.role} {r.backend}: {r.workers} x {r.gpus_per_worker} GPU" for r in roles)
