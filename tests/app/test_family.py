"""The policy's family, read from the checkpoint's own files, and the checks a config must pass
for it (at start and in ``--check``); Qwen2.5-VL's image positions in the trainer."""

from __future__ import annotations

import json

import pytest

from cua_rl.app import train
from cua_rl.app.family import check_family, detect_family, family_problems
from cua_rl.app.train import load_config
from cua_rl.errors import ConfigError
from cua_rl.testing.cache import ensure_model

# (kind, family name, patch size, DeepStack) as the released configs describe each family.
FAMILIES = [
    ("qwen2-vl-bpe", "qwen2-vl", 14, False),
    ("qwen2.5-vl", "qwen2.5-vl", 14, False),
    ("qwen3-vl", "qwen3-vl", 16, True),
    ("qwen3-vl-moe", "qwen3-vl-moe", 16, True),
]


@pytest.mark.parametrize(("kind", "name", "patch", "deepstack"), FAMILIES)
def test_family_is_read_from_the_checkpoint(kind, name, patch, deepstack):
    family = detect_family(ensure_model(kind))
    assert (family.name, family.patch_size, family.deepstack) == (name, patch, deepstack)
    assert family.context == 32768
    # The tiny processors' budget: at most 32 merged tokens per image.
    assert family.max_image_tokens == 32


def _config(tmp_path, model_dir, *overrides):
    return load_config(
        [
            "--config", "configs/local.yaml", f"cluster.fileroot={tmp_path}",
            f"actor.path={model_dir}", *overrides,
        ]
    )  # fmt: skip


def test_local_config_fits_every_family(tmp_path):
    for kind, *_ in FAMILIES:
        assert check_family(_config(tmp_path, ensure_model(kind))).name


def test_a_context_longer_than_the_checkpoints_is_refused_with_what_to_set(tmp_path):
    config = _config(tmp_path, ensure_model("qwen3-vl"), "vllm.max_model_len=65536")
    with pytest.raises(ConfigError, match="set vllm.max_model_len=32768 or less"):
        check_family(config)


def test_screenshots_that_cannot_fit_say_which_budget_would(tmp_path):
    config = _config(
        tmp_path, ensure_model("qwen3-vl"), "vllm.max_model_len=2048", "agent.max_steps=20"
    )
    (problem,) = family_problems(detect_family(config.actor.path), config)
    # 20 screenshots x (32 image + 200 text + 24 reply tokens) = 5120 > 2048; 2048 // 20 = 102
    # tokens per turn leave none for the screenshot at 224 text tokens: lower the steps.
    assert "20 screenshots at up to 32 tokens each needs about 5120 tokens" in problem
    assert "lower agent.max_steps" in problem
    config = _config(tmp_path, ensure_model("qwen3-vl"), "vllm.max_model_len=6000")
    config.agent.max_steps = 20
    config.trajectory.max_images = 20
    config.vllm.limit_mm_per_prompt = json.dumps({"image": 64})
    config.gconfig.max_new_tokens = 24
    config.vllm.max_model_len = 5000
    (problem,) = family_problems(detect_family(config.actor.path), config)
    # 5000 // 20 - 224 = 26 tokens per screenshot: 26 x 32 x 32 pixels.
    assert "max_pixels to at most 26624 (26 tokens per screenshot)" in problem


def test_a_kv_cache_that_cannot_hold_one_request_is_refused_with_the_size_that_does(tmp_path):
    # local.yaml: 16,384 tokens of fp32 in blocks of 16; the tiny models' cache takes 1 KiB a
    # token (vLLM's own count, tests/inference/test_vllm_server.py): 1,024 blocks and vLLM's
    # null block.
    need = 1025 * 16 * 1024
    config = _config(tmp_path, ensure_model("qwen3-vl"), f"vllm.kv_cache_memory_bytes={need - 1}")
    (problem,) = family_problems(detect_family(config.actor.path), config)
    assert f"set vllm.kv_cache_memory_bytes={need} or more" in problem, problem
    config = _config(tmp_path, ensure_model("qwen3-vl"), f"vllm.kv_cache_memory_bytes={need}")
    assert family_problems(detect_family(config.actor.path), config) == []


def test_too_few_images_per_row_is_refused(tmp_path):
    config = _config(tmp_path, ensure_model("qwen2.5-vl"), "+trajectory.max_images=2")
    with pytest.raises(ConfigError, match="set trajectory.max_images=3"):
        check_family(config)


def test_a_text_only_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no vision_config"):
        detect_family(ensure_model("qwen2-text"))


def test_check_reports_the_family(tmp_path, capsys):
    rc = train.main(
        [
            "--config", "configs/local.yaml", "--check", f"cluster.fileroot={tmp_path}",
            f"actor.path={ensure_model('qwen3-vl-moe')}", "gym.base_url=http://127.0.0.1:9",
            "agent.base_url=http://127.0.0.1:9", "+gym.timeouts.read_attempts=1",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1  # nothing listens on port 9
    (line,) = [ln for ln in out.splitlines() if " family " in ln]
    assert line.startswith("ok") and "qwen3-vl-moe (model_type qwen3_vl_moe)" in line, out
    assert "16-pixel patches, merge 2, DeepStack" in line


def test_start_refuses_a_config_the_family_cannot_fit(tmp_path, capsys):
    rc = train.main(
        [
            "--config", "configs/local.yaml", f"cluster.fileroot={tmp_path}",
            f"actor.path={ensure_model('qwen2.5-vl')}", "vllm.max_model_len=100000",
        ]
    )  # fmt: skip
    assert rc == 2
    assert "set vllm.max_model_len=32768 or less" in capsys.readouterr().err


def test_qwen2_5_vl_image_positions_start_where_the_image_does():
    """A still image's temporal position is where it starts (as vLLM computes it), not that
    times tokens_per_second as transformers 5.3 computes it for Qwen2.5-VL."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLModel

    from cua_rl.areal.positions import fix_qwen2_5_vl_image_positions

    fix_qwen2_5_vl_image_positions()
    config = AutoConfig.from_pretrained(ensure_model("qwen2.5-vl"))
    model = Qwen2_5_VLModel(config)
    # 3 text tokens, an image of 2x2 merged tokens (grid 1x4x4), 2 text tokens.
    ids = torch.tensor([[5, 6, 7, 12, 12, 12, 12, 8, 9]])
    types = (ids == 12).long()
    pos, _ = model.get_rope_index(ids, types, image_grid_thw=torch.tensor([[1, 4, 4]]))
    assert pos[:, 0].tolist() == [
        [0, 1, 2, 3, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 3, 4, 4, 5, 6],
        [0, 1, 2, 3, 4, 3, 4, 5, 6],
    ]
