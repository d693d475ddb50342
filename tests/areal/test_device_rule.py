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


class _RecordingActor:
    """The four actor methods ``--check``'s GPU step calls, recording where each call's tensors
    are (AReaL's own all-reduces, the advantage normalisation's, run on them under NCCL)."""

    def __init__(self):
        self.devices: dict[str, set[str]] = {}

    def _record(self, name, rows):
        found = self.devices.setdefault(name, set())
        stack = list(rows)
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                found.add(item.device.type)
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, list | tuple):
                stack.extend(item)

    def compute_logp(self, rows):
        self._record("compute_logp", rows)
        return [torch.zeros(r["input_ids"].shape[1]) for r in rows]

    def compute_advantages(self, rows):
        self._record("compute_advantages", rows)
        return rows

    def ppo_update(self, rows):
        self._record("ppo_update", rows)

    def export_stats(self):
        return {}


def test_the_gpu_step_hands_the_actor_its_rows_on_the_workers_device(monkeypatch):
    """In a training AReaL's RPC server moves each call's arguments to the worker's device; the
    step, which calls the actor in-process, must do the same (on an H200 it handed CPU rows to
    ``compute_advantages``, whose all-reduce NCCL refused)."""
    from cua_rl.testing import actor as testing_actor
    from cua_rl.testing import gpu_step

    monkeypatch.setattr(testing_actor, "worker_device", lambda: torch.device("meta"))
    rows = [
        {
            "input_ids": torch.ones(1, 6, dtype=torch.long),
            "multi_modal_input": [{"pixel_values": torch.zeros(4, 8)}],
        }
        for _ in range(2)
    ]
    actor = _RecordingActor()
    gpu_step._step(actor, rows)
    assert actor.devices == {
        "compute_logp": {"meta"},
        "compute_advantages": {"meta"},
        "ppo_update": {"meta"},
    }
