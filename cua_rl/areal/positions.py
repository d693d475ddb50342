"""Qwen2.5-VL's multimodal positions for still images, as vLLM computes them, in the trainer.

Qwen-VL models give each image token a (temporal, height, width) rotary position. For a still
image the temporal index is the position where the image starts. transformers 5.3 (the release
AReaL 1.0.4 pins) multiplies that index by ``tokens_per_second`` (4) for Qwen2.5-VL images as if
they were video frames, so every token after the first screenshot of a Qwen2.5-VL row is scored
at other positions than vLLM sampled it at (measured on the tiny Qwen2.5-VL: 0.075 nats on a
reply after one screenshot; vLLM and later transformers releases agree to 5e-7). The trainer
would then train on logprobs its own forward cannot reproduce.

``fix_qwen2_5_vl_image_positions`` replaces the temporal spacing by 1 when the installed
transformers shows the fault, checked by calling the function itself, so a fixed release is left
alone. Videos, the only inputs that need the spacing, are refused by the row builder.
``cua_rl.areal.actor`` applies it on import: every fsdp train engine's class is defined there or
in a module that imports it, and training workers import that class by its dotted path, whether
``logits.selective`` is on or off. ``cua_rl.testing.forward`` applies it before reproducing rows.
"""

from __future__ import annotations

_applied = False


def _faulty(fn) -> bool:
    import torch

    ids = fn(None, 3, torch.tensor([1, 2, 2]), 1, 1, 4)
    return int(ids[0, 0]) != 3


def fix_qwen2_5_vl_image_positions() -> bool:
    """Patch transformers' Qwen2.5-VL when it spaces still images' temporal positions; returns
    whether a patch is in place."""
    global _applied
    if _applied:
        return True
    try:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as mod
    except ImportError:
        return False
    # Declared in cua_rl.areal.support: a release without it fails the start-up check.
    original = mod.Qwen2_5_VLModel.get_vision_position_ids
    if not _faulty(original):
        return False

    def get_vision_position_ids(
        self,
        start_position,
        grid_thw,
        temp_merge_size=1,
        spatial_merge_size=1,
        time_interval=1,
        device=None,
    ):
        return original(
            self, start_position, grid_thw, temp_merge_size, spatial_merge_size, 1, device=device
        )

    mod.Qwen2_5_VLModel.get_vision_position_ids = get_vision_position_ids
    _applied = True
    return True
