"""``--check``'s GPU step: skipped and named where there is no CUDA; the step itself, run here.

This machine has no GPU, so the step module runs on its CPU (gloo), with the production actor
and a tiny model of each family built in a temporary folder: the same code ``--check`` runs in
a process of its own on a GPU node's first GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cua_rl.app.check_gpu import describe, gpu_check, run_step, step_lines, step_spec
from cua_rl.app.train import load_config

ROOT = Path(__file__).resolve().parents[2]
CUA = str(ROOT / "configs" / "cua.yaml")
SERVICES = [
    "gym.base_url=http://gym:8800", "gym.gym_id=android-world", "agent.base_url=http://agent:3000",
    "monitor.base_url=http://monitor:8000",
]  # fmt: skip


def _cua(*overrides):
    return load_config(["--config", CUA, *SERVICES, *overrides])


def _spec(**overrides):
    spec = {
        "family": "qwen2-vl",
        "tied": False,
        "dtype": "float32",
        "attn_impl": "sdpa",
        "vision": {"dedup": True, "pack_episodes": True, "freeze": False},
        "selective": True,
        "gradient_checkpointing": False,
    }
    return {**spec, **overrides}


def test_without_cuda_it_says_it_skipped_and_names_the_step(tmp_path):
    from cua_rl.testing.cache import ensure_model

    config = _cua(f"actor.path={ensure_model('qwen3-vl')}")
    (line,) = gpu_check(config, cuda=False)
    assert line.skipped and line.line().startswith("skip gpu-step")
    assert line.detail == (
        "no CUDA on this machine; on a GPU node --check runs one PPO step of a tiny "
        "random qwen3-vl (untied embeddings, bfloat16, attn_impl sdpa, vision dedup on, "
        "selective logits on, gradient checkpointing) on the first GPU under NCCL"
    )


def test_the_step_model_ties_its_embeddings_as_the_checkpoint_does():
    """AReaL wraps tied and untied models into different FSDP units: the step's tiny model
    follows the checkpoint (Qwen3-VL-2B ties them; the 8B, MAI-UI-8B's base, does not)."""
    from cua_rl.testing.cache import TIED, ensure_model

    for kind, word in (("qwen3-vl", "untied"), ("qwen3-vl" + TIED, "tied")):
        (line,) = gpu_check(_cua(f"actor.path={ensure_model(kind)}"), cuda=False)
        assert f"tiny random qwen3-vl ({word} embeddings, bfloat16" in line.detail


def test_a_cpu_config_skips_it():
    config = load_config(["--config", str(ROOT / "configs" / "local.yaml"), "actor.path=/m"])
    (line,) = gpu_check(config, cuda=True)
    assert line.skipped and line.detail == "cpu=true trains on the CPU harness"


def test_without_a_checkpoint_there_is_no_family_to_step():
    (line,) = gpu_check(_cua("actor.path=/models/absent"), cuda=True)
    assert not line.ok and line.detail.startswith("actor.path has no config.json: nothing to step")


def test_the_spec_follows_the_config():
    config = _cua(
        "actor.path=/m", "actor.vision.freeze=true", "logits.selective=false",
        "actor.attn_impl=flash_attention_2",
    )  # fmt: skip
    spec = step_spec(config, "qwen2.5-vl")
    assert spec == _spec(
        family="qwen2.5-vl",
        dtype="bfloat16",
        attn_impl="flash_attention_2",
        vision={"dedup": True, "pack_episodes": True, "freeze": True},
        selective=False,
        gradient_checkpointing=True,
    )
    assert "tower frozen, selective logits off" in describe(spec)


def test_a_failed_step_is_one_line_with_the_command_to_see_why():
    (line,) = step_lines(_spec(), {"ok": False, "error": "RuntimeError: No backend type"})
    assert not line.ok and line.name == "gpu-step"
    assert "failed on this node: RuntimeError: No backend type" in line.detail
    assert "python -m cua_rl.testing.gpu_step '{" in line.detail


def test_a_recompute_that_differs_from_the_forward_fails_the_step():
    result = {
        "ok": False, "loss_finite": True, "attn_impl": "sdpa", "device": "NVIDIA H200",
        "backend": "nccl", "step_s": 1.0, "torch": "2.10.0", "selective": True,
        "recompute": {"max_rel": 1.1e-2, "worst": "model.visual.blocks.0.norm1.weight",
                      "tolerance": 2.0**-8, "ok": False},
    }  # fmt: skip
    (line,) = step_lines(_spec(gradient_checkpointing=True), result)
    assert not line.ok
    assert "checkpointed gradients within 1.1e-02 of the forward's (tolerance 3.9e-03)" in (
        line.detail
    )
    assert "recomputes something the forward did not" in line.detail
    assert "model.visual.blocks.0.norm1.weight" in line.detail and "2.10.0" in line.detail


@pytest.mark.slow
def test_the_step_runs_the_production_actor_as_a_node_does_and_reports_it():
    """MAI-UI's family as MAI-UI-8B is (untied), in bf16 with checkpointing, on the recompute
    of the torch a GPU node runs (emulated): the step and its recompute check pass."""
    from cua_rl.testing.gpu_step import OLD_RECOMPUTE_ENV

    family = "qwen3-vl"  # a lent GPU machine steps the others (docs/gpu.md)
    # flash_attention_2 where flash-attn does not import: reported, and the step runs with sdpa.
    spec = _spec(
        family=family, dtype="bfloat16", attn_impl="flash_attention_2",
        gradient_checkpointing=True,
    )  # fmt: skip
    result = run_step(spec, {**os.environ, OLD_RECOMPUTE_ENV: "1"})
    assert result["ok"], result
    assert result["old_recompute"] is True
    assert result["recompute"]["max_rel"] <= result["recompute"]["tolerance"] == 1e-6
    assert result["recompute"]["vision_params"] > 5
    assert result["backend"] == "gloo" and result["attn_impl"] == "sdpa"
    assert "flash_attn" in result["attention_problem"]
    assert result["selective"] is True
    # Two episodes of 4 calls with a 3-screenshot window: 18 images in the rows, 8 distinct,
    # each encoded once in the update's one micro-batch.
    stats = result["stats"]
    assert stats["cua_vision/row_images"] == 18
    assert stats["cua_vision/encoded_images"] == stats["cua_vision/distinct_images"] == 8
    assert stats["ppo_actor/update/grad_norm"] > 0
    attention, step = step_lines(spec, result)
    assert not attention.ok and "set actor.attn_impl=sdpa" in attention.detail
    assert step.ok and f"tiny random {family}" in step.detail and "with sdpa on cpu" in step.detail
    assert "checkpointed gradients within" in step.detail
