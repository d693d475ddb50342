"""The CPU harness is chosen by the config's ``cpu``, never by the trainer's CUDA: a Ray or Slurm
trainer without CUDA keeps AReaL's GPU path; a local GPU config without CUDA stops at start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from areal.api.cli_args import load_expr_config

from cua_rl.app.config import CUAConfig
from cua_rl.app.harness import cuda_available, use_cpu_harness
from cua_rl.app.train import configure_platform
from cua_rl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PROD = ROOT / "configs" / "cua.yaml"
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there
REQUIRED = [
    # A hub id: nothing to look for on this machine (a missing local folder is refused at the
    # load, before what these tests are about; preflight.py).
    "actor.path=Qwen/Qwen3-VL-8B-Instruct",
    f"gym.base_url={CLOSED}",
    "gym.gym_id=android-world",
    f"agent.base_url={CLOSED}",
    f"monitor.base_url={CLOSED}",
]
SHAPES = {
    "local": ["scheduler.type=local"],
    "ray": ["scheduler.type=ray"],
    "slurm": [
        "scheduler.type=slurm",
        "cluster.n_nodes=2",
        "actor.backend=fsdp:d8",
        "rollout.backend=vllm:d8",
    ],
}
NO_CUDA = "needs CUDA on this machine"


def _argv(tmp_path: Path, scheduler: str, *extra: str) -> list[str]:
    (tmp_path / "nr").mkdir(parents=True, exist_ok=True)
    return [
        "--config",
        str(PROD),
        f"cluster.fileroot={tmp_path}",
        f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}",
        *REQUIRED,
        *SHAPES[scheduler],
        *extra,
    ]


def load(tmp_path: Path, scheduler: str, *extra: str) -> CUAConfig:
    return load_expr_config(_argv(tmp_path, scheduler, *extra), CUAConfig)[0]


@pytest.mark.parametrize("scheduler", ["ray", "slurm"])
def test_a_cluster_trainer_without_cuda_keeps_the_gpu_path(tmp_path, scheduler):
    cfg = load(tmp_path, scheduler)
    assert use_cpu_harness(cfg, cuda=False) is False
    assert use_cpu_harness(cfg, cuda=True) is False


def test_a_local_gpu_config_without_cuda_is_refused_with_the_fix(tmp_path):
    cfg = load(tmp_path, "local")
    with pytest.raises(ConfigError, match=f"{NO_CUDA}.*CUDA_VISIBLE_DEVICES.*set cpu=true"):
        use_cpu_harness(cfg, cuda=False)
    assert use_cpu_harness(cfg, cuda=True) is False


@pytest.mark.parametrize("scheduler", ["local", "ray", "slurm"])
def test_cpu_true_selects_the_harness_whatever_the_machine(tmp_path, scheduler):
    cfg = load(tmp_path, scheduler, "cpu=true")
    assert use_cpu_harness(cfg, cuda=True) is True
    assert use_cpu_harness(cfg, cuda=False) is True


def test_the_slurm_start_up_leaves_areal_as_it_is(tmp_path):
    """configure_platform on a slurm GPU config: vLLM from its own environment (the worker
    command and the interpreter), disk weight updates, no CPU worker command, no native
    (container-less) Slurm patch."""
    from areal.infra.scheduler.slurm import SlurmScheduler

    python = tmp_path / "vllm-cuda" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    cfg = load(tmp_path, "slurm", f"inference.python={python}")
    init = SlurmScheduler.__init__
    configure_platform(cfg)
    assert SlurmScheduler.__init__ is init
    assert cfg.actor.weight_update_mode == "disk"
    assert cfg.vllm.worker_extension_cls == "cua_rl.inference.vllm_worker.DiskWeightReloadExtension"
    for spec in (cfg.actor.scheduling_spec[0], cfg.rollout.scheduling_spec[0]):
        assert spec.gpu == 1 and spec.cmd == "python -m cua_rl.areal.worker"
        assert spec.env_vars["CUA_VLLM_PYTHON"] == str(python)


def test_a_gpu_start_without_the_inference_environment_says_how_to_make_it(tmp_path):
    cfg = load(tmp_path, "local", f"inference.python={tmp_path / 'none' / 'python'}")
    with pytest.raises(ConfigError, match="does not exist: run `make gpu-stack`"):
        configure_platform(cfg)


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.backend=sglang:d4"],  # environment auto: SGLang runs from AReaL's
        ["inference.environment=areal", "actor.weight_update_mode=xccl"],
    ],
)
def test_areals_own_launch_is_left_as_it_is(tmp_path, overrides):
    cfg = load(tmp_path, "local", *overrides)
    assert not cfg.inference.own(cfg)
    configure_platform(cfg)
    assert cfg.rollout.scheduling_spec[0].cmd == "python -m cua_rl.areal.worker"
    assert "CUA_VLLM_PYTHON" not in cfg.rollout.scheduling_spec[0].env_vars


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["inference.environment=own", "rollout.backend=sglang:d4"],
            "only vLLM runs from an environment of its own",
        ),
        (
            ["actor.weight_update_mode=xccl"],
            "no NCCL weight routes; set actor.weight_update_mode=disk",
        ),
    ],
)
def test_what_an_own_environment_cannot_serve_is_refused(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load(tmp_path, "local", *overrides)


def _train(tmp_path: Path, scheduler: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "examples.cua_agent.train", *_argv(tmp_path, scheduler)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA: nothing to refuse")
def test_the_trainer_stops_at_start_under_local_without_cuda(tmp_path):
    proc = _train(tmp_path, "local")
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and NO_CUDA in errors[0] and "cpu=true" in errors[0]


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA: the test needs none")
def test_the_trainer_goes_on_under_ray_without_cuda(tmp_path):
    """Past the decision the trainer asks the gym for its tasks (nothing listens: it fails
    there, after the point where a local run stops)."""
    proc = _train(tmp_path, "ray")
    assert NO_CUDA not in proc.stderr
    assert "service error: gym list tasks" in proc.stderr, proc.stderr[-2000:]
