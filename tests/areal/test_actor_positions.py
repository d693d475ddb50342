"""The Qwen2.5-VL image-position fix reaches the training worker whichever actor runs.

A training worker imports only its engine class, by the dotted path AReaL's controller sends it.
Each case asks the trainer factory (``trainer_class`` then ``_create_train_engine``, as the
launcher does) for the engine class with ``logits.selective`` on and off, imports that path in a
fresh interpreter, and reads a still image's rotary positions from transformers' Qwen2.5-VL:
the temporal index must be where the image starts (vLLM's rule), not 4x that. The control
imports AReaL's own ``FSDPPPOActor`` and sees the fault, so the check can fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cua_rl.areal.logits import LogitsConfig, trainer_class
from cua_rl.testing.cache import ensure_model

ROOT = Path(__file__).resolve().parents[2]

# Import one class by its dotted path, then 3 text tokens, an image of 2x2 merged tokens
# (grid 1x4x4, image token 12) and 2 text tokens through Qwen2.5-VL's rope index.
_WORKER = """
import importlib, json, sys
import torch
from transformers import AutoConfig, Qwen2_5_VLModel
module, name = sys.argv[1].rsplit(".", 1)
getattr(importlib.import_module(module), name)
model = Qwen2_5_VLModel(AutoConfig.from_pretrained(sys.argv[2]))
ids = torch.tensor([[5, 6, 7, 12, 12, 12, 12, 8, 9]])
pos, _ = model.get_rope_index(ids, (ids == 12).long(), image_grid_thw=torch.tensor([[1, 4, 4]]))
print(json.dumps(pos[0, 0].tolist()))
"""
# Temporal positions: the image's four tokens at 3, where it starts.
VLLM_TEMPORAL = [0, 1, 2, 3, 3, 3, 3, 5, 6]


def _engine_class_path(selective: bool) -> str:
    """The engine class the trainer factory hands AReaL's controller for an fsdp actor."""
    cls = trainer_class(LogitsConfig(selective=selective))
    trainer = cls.__new__(cls)  # the factory reads only the scheduler
    trainer.scheduler = None
    from areal.api.alloc_mode import ModelAllocation

    from cua_rl.testing.actor import actor_config, init_single_process_group

    # The factory makes the engine, which joins a process group: this process's one-rank group
    # on loopback, with the environment the in-process actor tests after this one read.
    init_single_process_group()
    config = actor_config(ensure_model("qwen2.5-vl"))
    alloc = ModelAllocation.from_str(config.backend, name="actor")
    controller = trainer._create_train_engine(config, alloc)
    engine = controller.train_engine
    return f"{engine.__module__}.{engine.__qualname__}"


def _temporal_positions(class_path: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", _WORKER, class_path, str(ensure_model("qwen2.5-vl"))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("selective", [False, True], ids=["selective-off", "selective-on"])
def test_the_worker_that_imports_the_engine_class_has_vllms_positions(selective):
    path = _engine_class_path(selective)
    assert path.startswith("cua_rl.areal.")
    assert _temporal_positions(path) == VLLM_TEMPORAL


@pytest.mark.slow
def test_control_areals_own_actor_alone_leaves_the_fault():
    positions = _temporal_positions("areal.engine.fsdp_engine.FSDPPPOActor")
    assert positions[3:7] == [12, 12, 12, 12]  # 3 x tokens_per_second (4): transformers 5.3
