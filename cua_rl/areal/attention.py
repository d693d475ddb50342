"""transformers' SDPA attention that keeps AReaL's packed sequences apart, exactly and cheaply.

AReaL's FSDP engine packs a micro-batch into one row and passes the boundaries as
``cu_seq_lens_q/k`` with every per-layer mask set to None (``areal/engine/fsdp_engine.py``,
``_prepare_mb_list``). ``flash_attention_2`` reads those boundaries; transformers' SDPA and eager
ignore them and run one causal attention over the whole row, so every sequence after the first
attends to the ones before it (on the tiny Qwen2 that moved the second sequence's logprobs by up
to 0.94 nats).

``packed_sdpa`` runs SDPA once per packed sequence (padding after the last boundary is a block
of its own) and concatenates the outputs: exact against each sequence's unpacked forward, with
no mask at all, so torch keeps its fused kernels (flash or memory-efficient on a GPU) and memory
stays linear in the row. A dense block-diagonal mask would be L x L per layer call: gigabytes at
the 49k tokens of a GPU micro-batch. Calls without boundaries (unpacked rows, the vision tower,
which splits its own images) go to transformers' SDPA unchanged.

``keep_packed_sequences_apart()`` installs it as ``"sdpa"`` in the process; the actor's module
(``cua_rl.areal.actor``) calls it on import, so every fsdp train engine with
``actor.attn_impl: sdpa`` gets it, on a GPU as on CPU.
"""

from __future__ import annotations

import torch

_BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def sequence_bounds(cu_seq_lens: torch.Tensor, length: int) -> list[tuple[int, int]]:
    """The [start, end) of each packed sequence of a row of ``length`` tokens; padding after the
    last boundary is a sequence of its own, empty spans are left out."""
    cuts = [int(x) for x in cu_seq_lens.tolist()]
    if not cuts or cuts[0] != 0:
        cuts.insert(0, 0)
    if cuts[-1] < length:
        cuts.append(length)
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


def packed_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function signature (query ``[1, heads, L, dim]``); returns the
    output ``[1, L, heads, dim]`` and no weights, as ``sdpa_attention_forward`` does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or attention_mask is not None or query.shape[0] != 1 or query.shape[2] <= 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in _BOUNDARY_KWARGS}
    bounds = sequence_bounds(cu, query.shape[2])
    if len(bounds) == 1:
        return sdpa_attention_forward(module, query, key, value, None, **rest)
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, **rest
        )[0]
        for a, b in bounds
    ]
    return torch.cat(outputs, dim=1), None


def keep_packed_sequences_apart() -> None:
    """Make ``attn_implementation="sdpa"`` respect AReaL's packed sequence boundaries."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = packed_sdpa
