"""The actor's step as a GPU node runs it, on torch <= 2.12's recompute, for every family.

A GPU node trains in bf16 with fp32 master weights (AReaL: the model in fp32, FSDP2's mixed
precision casting to bf16), with gradient checkpointing, FSDP units as AReaL wraps them (each
embedding its own unit when word embeddings are untied), on the torch AReaL's GPU environment
resolves (2.10), whose FSDP2 does not cast a checkpointed layer's inputs when it recomputes it.
This suite's torch (2.13) does; ``cua_rl.testing.old_recompute`` puts the old behaviour back.

Each family, tied and untied, takes a ``ppo_update`` with checkpointing under that emulation and
the same update without checkpointing (``cua_rl.testing.recompute_check``): the gradients must be
equal (CPU kernels are deterministic, so a faithful recompute repeats the forward exactly), with
the project's vision path (selective logits, each screenshot through the tower once) and with
AReaL's (both off). Without ``cua_rl.areal.recompute`` Qwen3-VL with untied embeddings stops as
it did on an H200, and the others' gradients move by about 1e-2.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cua_rl.testing.cache import TIED
from cua_rl.testing.old_recompute import old_fsdp_recompute
from cua_rl.testing.recompute_check import CPU_TOLERANCE, recompute_check

FAMILIES = ("qwen2-vl-bpe", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe")


@pytest.fixture(autouse=True)
def _sdpa_restored():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from cua_rl.areal.attention import keep_packed_sequences_apart

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    keep_packed_sequences_apart()
    yield
    ALL_ATTENTION_FUNCTIONS["sdpa"] = original


def _actor(kind: str, *, path: str = "project", engine: type | None = None):
    """An actor as a GPU node builds it: bf16 compute, fp32 master weights, checkpointing."""
    from cua_rl.areal.actor import CuaPPOActor
    from cua_rl.areal.logits_engine import SelectiveLogitsPPOActor
    from cua_rl.areal.vision import VisionSection
    from cua_rl.testing.actor import actor_config, make_actor
    from cua_rl.testing.cache import ensure_model

    model_dir = ensure_model(kind)
    project = path == "project"
    config = actor_config(
        model_dir,
        dtype="bfloat16",
        gradient_checkpointing=True,
        vision=VisionSection(dedup=project),
    )
    cls = engine or (SelectiveLogitsPPOActor if project else CuaPPOActor)
    return make_actor(cls, config), model_dir


def _batch(actor, model_dir) -> list[dict]:
    """Two MAI-UI episodes (4 calls, 3-screenshot window) ready for ``ppo_update``, with a stale
    proximal policy so that the loss does not vanish."""
    from cua_rl.testing.actor import delivered, group_rows, vision_geometry

    vocab = actor.model.get_output_embeddings().weight.shape[0]
    patch_dim, merge = vision_geometry(model_dir)
    rows = group_rows(4, window=3, vocab_size=vocab, patch_dim=patch_dim, merge=merge)
    gen = torch.Generator().manual_seed(7)
    logps = actor.compute_logp(delivered(copy.deepcopy(rows)))
    for row, logp in zip(rows, logps, strict=True):
        row["prox_logp"] = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    actor.export_stats()
    batch = actor.compute_advantages(delivered(rows))
    actor.export_stats()
    return batch


def _fsdp_embeddings(actor) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [
        name
        for name, module in actor.model.named_modules()
        if isinstance(module, FSDPModule) and isinstance(module, torch.nn.Embedding)
    ]


def _hooked(actor) -> list[str]:
    from cua_rl.areal.recompute import checkpointed_layers

    names = {id(m): n for n, m in actor.model.named_modules()}
    return [names[id(m)] for m in checkpointed_layers(actor.model)]


def _check(kind: str, **kwargs) -> tuple[dict, list[str], list[str]]:
    """The recompute check under the emulation; the FSDP embedding units and the layers the
    rule hooks."""
    actor, model_dir = _actor(kind, **kwargs)
    try:
        batch = _batch(actor, model_dir)
        with old_fsdp_recompute():
            result = recompute_check(actor, batch)
        return result, _fsdp_embeddings(actor), _hooked(actor)
    finally:
        actor.destroy()


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_project_actor_recomputes_what_its_forward_computed(family, tied):
    result, embeddings, hooked = _check(family + (TIED if tied else ""))
    # AReaL's wrapping, as on a node: untied, every embedding is an FSDP unit of its own.
    assert (embeddings == []) is tied, embeddings
    assert result["max_rel"] <= CPU_TOLERANCE, result
    assert result["vision_params"] > 5, result
    # The rule hooks the layers checkpointing wraps (two vision blocks, two decoder layers in
    # every tiny model), not the embeddings AReaL also wraps, nor the towers transformers marks.
    assert [name.rsplit(".", 1)[0] for name in hooked] == [
        "model.visual.blocks", "model.visual.blocks",
        "model.language_model.layers", "model.language_model.layers",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2-vl-bpe", "qwen3-vl"])
def test_areals_vision_path_recomputes_what_its_forward_computed(family):
    """AReaL's vision path (every image of every row through the tower, full logits) in the
    project's actor: the two mechanisms, Qwen2-VL's silent one and Qwen3-VL's stop."""
    result, _, _ = _check(family, path="areal")
    assert result["max_rel"] <= CPU_TOLERANCE, result
    assert result["vision_params"] > 5, result


@pytest.mark.slow
def test_the_emulation_stops_areals_own_actor_as_the_h200_did():
    """AReaL's ``FSDPPPOActor`` (no recompute rule) on Qwen3-VL with untied embeddings: the
    update stops in the recomputed vision block under the emulation, and not without it."""
    from areal.engine.fsdp_engine import FSDPPPOActor

    from cua_rl.testing.actor import delivered

    actor, model_dir = _actor("qwen3-vl", path="areal", engine=FSDPPPOActor)
    try:
        batch = _batch(actor, model_dir)
        with old_fsdp_recompute(), pytest.raises(RuntimeError, match="dtype"):
            actor.ppo_update(delivered(copy.deepcopy(batch)))
        actor.ppo_update(delivered(copy.deepcopy(batch)))  # torch 2.13's own recompute
        stats = actor.export_stats()
        assert stats["ppo_actor/update/grad_norm"] > 0
    finally:
        actor.destroy()


@pytest.mark.slow
def test_the_emulation_moves_qwen2_vl_gradients_without_the_rule():
    """Qwen2-VL does not stop: its vision blocks recompute on fp32 rotary embeddings where the
    forward used bf16, and the gradients move, silently, by far more than the tolerance."""
    from areal.engine.fsdp_engine import FSDPPPOActor

    result, _, _ = _check("qwen2-vl-bpe", path="areal", engine=FSDPPPOActor)
    assert result["max_rel"] > 1e-3, result
    assert ".visual." in result["worst"], result


def test_without_a_checkpointed_layer_the_rule_refuses_instead_of_guarding_nothing():
    from cua_rl.areal.recompute import cast_recomputed_inputs
    from cua_rl.errors import CuaRlError

    with pytest.raises(CuaRlError, match="GradientCheckpointingLayer"):
        cast_recomputed_inputs(torch.nn.Sequential(torch.nn.Linear(2, 2)))
