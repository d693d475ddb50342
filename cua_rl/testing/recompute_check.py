"""Recompute equals forward: a checkpointed step's gradients against the same step's without.

Gradient checkpointing must not change what is trained: the layers it recomputes in the
backward pass must compute what the forward did. ``recompute_check`` runs one ``ppo_update`` of
a gradient-checkpointing actor on a batch, then the same update with checkpointing switched off
on the same weights (learning rate 0 for both, so the optimizer runs and changes nothing), and
compares every parameter's gradient: the largest relative L2 difference and where it is.

Tolerances (``CPU_TOLERANCE``, ``GPU_TOLERANCE``): on a CPU the kernels are deterministic and
a faithful recompute repeats the forward bit for bit (measured: 0.0 for every family, bf16 with
fp32 master weights); on a GPU some backward kernels accumulate in a varying order, so the bound
is one bf16 step (2^-8) of relative L2 difference. An unfaithful recompute measured about 1e-2
(Qwen2-VL's vision blocks on fp32 rotary embeddings, torch <= 2.12's recompute) or crashed
(Qwen3-VL with untied embeddings). Used by ``tests/areal/test_recompute.py`` on CPU and by
``cua_rl.testing.gpu_step`` (``--check`` and the GPU device script) on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

CPU_TOLERANCE = 1e-6
GPU_TOLERANCE = 2.0**-8


def gradients(actor: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient after an update, whole (FSDP shards gathered)."""
    out = {}
    for name, param in actor.model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        out[name] = grad.detach().float().clone()
    return out


@contextlib.contextmanager
def _learning_rate_zero(actor: Any) -> Iterator[None]:
    # AReaL's scheduler sets each step's rate after the optimizer ran: zeroed before each update.
    groups = actor.optimizer.param_groups
    saved = [group["lr"] for group in groups]
    try:
        yield
    finally:
        for group, lr in zip(groups, saved, strict=True):
            group["lr"] = lr


def _update(actor: Any, batch: list[dict]) -> dict[str, torch.Tensor]:
    for group in actor.optimizer.param_groups:
        group["lr"] = 0.0
    actor.ppo_update(copy.deepcopy(batch))
    actor.export_stats()
    return gradients(actor)


def recompute_check(actor: Any, batch: list[dict]) -> dict[str, Any]:
    """Gradients of ``batch``'s update with and without checkpointing; their largest relative
    difference (``max_rel``), the parameter it is in (``worst``), how many parameters had a
    gradient (``params``) and how many of the vision tower's were non-zero (``vision_params``).

    ``batch`` is what ``ppo_update`` takes (advantages computed, ``prox_logp`` set), on the
    worker's device. The actor must have been created with gradient checkpointing on.
    """
    if not actor.config.gradient_checkpointing:
        raise ValueError("recompute_check needs an actor with gradient_checkpointing=True")
    with _learning_rate_zero(actor):
        checkpointed = _update(actor, batch)
        actor.model.gradient_checkpointing_disable()
        try:
            plain = _update(actor, batch)
        finally:
            # As AReaL enables it (areal/engine/fsdp_engine.py, _create_device_model).
            actor.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    if checkpointed.keys() != plain.keys():
        raise AssertionError("the two updates gave gradients to different parameters")
    rel = {
        name: ((checkpointed[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        for name, g in plain.items()
    }
    worst = max(rel, key=rel.get)
    return {
        "max_rel": rel[worst],
        "worst": worst,
        "params": len(rel),
        "vision_params": sum(1 for n, g in plain.items() if ".visual." in n and g.norm() > 0),
    }
