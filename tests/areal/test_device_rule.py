"""Every statistic cua-rl hands AReaL's stats tracker is on the engine's device.

``export_stats`` all-reduces the tracker's tensors over the data-parallel group. Gloo (a CPU
run) takes CPU tensors; NCCL (every GPU run) refuses them, "No backend type associated with
device type cpu", which stopped the first GPU training at its first step. A CPU run cannot see
that, so these tests give the helpers and the actor a device other than the CPU (``meta``) and
look at where the tracker's tensors were made.
"""

from __future__ import annotations

import copy

import pytest
import torch
from areal.utils import stats_tracker

from cua_rl.areal import vision_dedup as vd


@pytest.fixture
def tracker():
    stats_tracker.DEFAULT_TRACKER.export()  # start empty
    yield stats_tracker.DEFAULT_TRACKER
    stats_tracker.DEFAULT_TRACKER.stats.clear()


def _devices(tracker, prefix: str) -> dict[str, set[str]]:
    return {
        key: {v.device.type for v in values}
        for key, values in tracker.stats.items()
        if key.startswith(prefix)
    }


def test_a_count_is_made_on_the_device_it_is_given(tracker):
    vd.count("row_images", 7, torch.device("meta"))
    vd.count("encoded_images", 0, "meta")
    assert _devices(tracker, "cua_vision/") == {
        "cua_vision/row_images": {"meta"},
        "cua_vision/encoded_images": {"meta"},
    }


def test_a_count_holds_its_number(tracker):
    vd.count("row_images", 7, "cpu")
    vd.count("row_images", 0, "cpu")
    assert tracker.export()["cua_vision/row_images"] == 7


@pytest.mark.slow
def test_the_actor_counts_its_images_on_its_own_device(tracker):
    """The real actor's micro-batch planning, with the engine's device set to ``meta``."""
    from cua_rl.areal.actor import CuaPPOActor
    from cua_rl.testing.actor import actor_config, make_actor, vision_geometry, window_rows
    from cua_rl.testing.cache import ensure_model

    model_dir = ensure_model("qwen2-vl-byte")
    actor = make_actor(CuaPPOActor, actor_config(model_dir))
    try:
        vocab = actor.model.get_output_embeddings().weight.shape[0]
        patch_dim, merge = vision_geometry(model_dir)
        rows = window_rows(4, window=3, vocab_size=vocab, patch_dim=patch_dim, merge=merge)
        batch, _ = actor._normalize_batch_input(copy.deepcopy(rows))
        tracker.export()
        device = actor.device
        actor.device = torch.device("meta")
        try:
            actor._prepare_mb_list(batch)
        finally:
            actor.device = device
        assert _devices(tracker, "cua_vision/") == {
            "cua_vision/row_images": {"meta"},
            "cua_vision/distinct_images": {"meta"},
        }
    finally:
        actor.destroy()
