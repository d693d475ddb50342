"""A checkpointed layer's recompute sees what its forward saw, on every torch AReaL may carry.

FSDP2's mixed precision (AReaL: ``param_dtype=actor.dtype``, ``cast_forward_inputs=True``, fp32
master weights) casts each FSDP unit's floating inputs to the compute dtype in its pre-forward
hook. When gradient checkpointing recomputes that unit in the backward pass the hook runs again,
in FSDP's pre-backward state, and torch <= 2.12 returns the inputs uncast there (pytorch #159359;
2.13 casts them, #182580). AReaL 1.0.4's GPU environment resolves torch 2.10. So wherever an
input arrives in fp32 the recompute computes something the forward did not: Qwen3-VL's vision
tower builds its position embeddings with the fp32 master weight's dtype (``pos_embed`` is an FSDP
unit of its own when word embeddings are untied, as in Qwen3-VL-8B and MAI-UI-8B), its first
block's ``norm1`` meets an fp32 input and a bf16 weight, and the backward stops; Qwen2-VL's
blocks recompute with fp32 rotary embeddings where the forward used bf16, silently.

``cast_recomputed_inputs(model)`` gives every FSDP unit that a checkpointed layer's recompute
runs (each layer gradient checkpointing wraps, and the units inside it) a forward pre-hook that
casts its inputs, and a forward hook that casts its outputs, exactly as the unit's own policy
casts them in the forward. The hooks run inside the checkpointed call, after FSDP's own
pre-forward, so they are no-ops wherever torch already cast (the first forward; the recompute
on torch >= 2.13) and do FSDP's cast where it did not. The rule is general: no family or module
is named. ``cua_rl.areal.actor.CuaPPOActor`` installs it after AReaL wraps the model; the torch
names it reads are declared in ``cua_rl.areal.support``.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from cua_rl.errors import CuaRlError


def _casts(module: nn.Module) -> tuple[Any, Any] | None:
    """(input dtype, output dtype) the FSDP unit ``module`` casts to in its forward, or None."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None
    policy = module._get_fsdp_state()._mp_policy
    inputs = policy.param_dtype if policy.cast_forward_inputs else None
    if inputs is None and policy.output_dtype is None:
        return None
    return inputs, policy.output_dtype


def _cast(dtype, value):
    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    return _apply_to_tensors(functools.partial(_cast_fp_tensor, dtype), value)


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The layers gradient checkpointing wraps: transformers' ``GradientCheckpointingLayer``s
    with checkpointing on (each runs its own call, hooks included, inside the checkpoint).
    Models also mark the towers that hold them (``gradient_checkpointing = True`` on the
    vision model and the language model), which are not recomputed: the type tells them apart."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [
        m
        for m in model.modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]


def cast_recomputed_inputs(model: nn.Module) -> int:
    """Hook every FSDP unit a checkpointed layer's recompute runs; returns how many.

    Raises ``CuaRlError`` when the model has no checkpointed layer (transformers marks them
    otherwise now, and the recompute would go unguarded): call it only with checkpointing on.
    """
    layers = checkpointed_layers(model)
    if not layers:
        raise CuaRlError(
            "gradient checkpointing is on but no layer of the model is a transformers "
            "GradientCheckpointingLayer with checkpointing on: cua_rl/areal/recompute.py cannot "
            "make the recompute cast as the forward did; set actor.gradient_checkpointing=false "
            "and report this"
        )
    hooked = 0
    seen: set[int] = set()
    for layer in layers:
        for unit in layer.modules():
            if id(unit) in seen:
                continue
            seen.add(id(unit))
            casts = _casts(unit)
            if casts is None:
                continue
            inputs, output = casts
            if inputs is not None:
                unit.register_forward_pre_hook(
                    lambda _m, args, kwargs, dtype=inputs: (
                        _cast(dtype, args),
                        _cast(dtype, kwargs),
                    ),
                    with_kwargs=True,
                )
            if output is not None:
                unit.register_forward_hook(lambda _m, _a, out, dtype=output: _cast(dtype, out))
            hooked += 1
    return hooked
