"""``actor.vision.freeze``: the tower gets no gradient, keeps its weights, and runs without autograd.

Two real AReaL actors on CPU (one process, gloo, fp32) from the same tiny Qwen3-VL (DeepStack
included), frozen and not, take one ``ppo_update`` with a non-zero learning rate on the same
MAI-UI-style rows. Gradient clipping is off so that the language model's gradients of both runs
are the loss's own (clipping by a global norm that includes the tower's would scale them).
"""

from __future__ import annotations

import copy

import pytest
import torch

from cua_rl.areal.vision_dedup import vision_tower


@pytest.fixture(scope="module")
def actors():
    from areal.api.cli_args import OptimizerConfig
    from areal.utils import stats_tracker
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from cua_rl.areal.actor import CuaPPOActor
    from cua_rl.areal.attention import keep_packed_sequences_apart
    from cua_rl.testing.actor import actor_config, make_actor
    from cua_rl.testing.cache import ensure_model

    original_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    keep_packed_sequences_apart()
    model_dir = ensure_model("qwen3-vl")
    optimizer = OptimizerConfig(
        lr=1e-2,
        weight_decay=0.0,
        warmup_steps_proportion=0.0,
        lr_scheduler_type="constant",
        gradient_clipping=1e9,
    )
    config = actor_config(model_dir, optimizer=optimizer)
    config.mb_spec.max_tokens_per_mb = 260
    unfrozen = make_actor(CuaPPOActor, copy.deepcopy(config))
    config.vision.freeze = True
    frozen = make_actor(CuaPPOActor, config)
    stats_tracker.export_all()
    yield unfrozen, frozen, model_dir
    for actor in (frozen, unfrozen):
        actor.destroy()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = original_sdpa


def _rows(actor, model_dir) -> list[dict]:
    from cua_rl.testing.actor import vision_geometry, window_rows

    vocab = actor.model.get_output_embeddings().weight.shape[0]
    patch_dim, merge = vision_geometry(model_dir)
    rows = [
        row
        for seed in (1, 2)
        for row in window_rows(
            4, window=3, vocab_size=vocab, patch_dim=patch_dim, merge=merge, seed=seed
        )
    ]
    gen = torch.Generator().manual_seed(7)
    for row in rows:
        # A stale proximal policy: the ratios differ from 1 and the loss does not vanish.
        row["prox_logp"] = row["logprobs"] + 0.3 * torch.randn(row["logprobs"].shape, generator=gen)
    return rows


def _full(param: torch.Tensor) -> torch.Tensor:
    local = getattr(param, "to_local", None)  # FSDP2 shards parameters as DTensors
    return (local() if local is not None else param).detach().clone()


@pytest.mark.slow
def test_frozen_tower_keeps_its_weights_and_the_language_model_its_gradients(actors):
    unfrozen, frozen, model_dir = actors
    rows = _rows(unfrozen, model_dir)
    before = {n: _full(p) for n, p in frozen.model.named_parameters()}
    outputs = []
    hook = vision_tower(frozen.model).register_forward_hook(
        lambda m, a, out: outputs.append(out.pooler_output)
    )
    results = []
    for actor in (unfrozen, frozen):
        actor.ppo_update(actor.compute_advantages(copy.deepcopy(rows)))
        actor.export_stats()
        results.append({n: p.grad for n, p in actor.model.named_parameters()})
    hook.remove()
    free, held = results

    # The tower ran (once per micro-batch) without autograd.
    assert outputs and all(o.grad_fn is None and not o.requires_grad for o in outputs)
    tower = {n for n in held if ".visual." in n}
    assert len(tower) > 5
    for name, param in frozen.model.named_parameters():
        if name in tower:
            assert held[name] is None and not param.requires_grad, name
            assert torch.equal(_full(param), before[name]), name  # bit-identical
    # The language model trained (lr 1e-2), with the unfrozen run's gradients.
    lm = [n for n in held if n not in tower]
    assert any(not torch.equal(_full(p), before[n]) for n, p in frozen.model.named_parameters())
    assert all(free[n] is not None for n in tower)
    for name in lm:
        want, have = _full(free[name]), _full(held[name])
        diff = (want - have).norm() / want.norm().clamp_min(1e-30)
        assert diff.item() < 1e-5, name
