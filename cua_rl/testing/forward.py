"""What the trainer would compute for a row: a transformers forward pass of the same model.

Tests compare recorded logprobs with it: ``next_token_logprobs(model, row)[i]`` is the logprob
of token ``i`` given tokens ``< i`` (0 at position 0), under logits divided by ``temperature``
and, when given, restricted to ``allowed`` ids or with ``banned`` ids removed (what vLLM's
allowed_token_ids or min_tokens did to the distribution it sampled from).
"""

from __future__ import annotations

from collections.abc import Sequence


def load_vl_model(model_dir):
    """The model class its config.json names (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE)."""
    import torch
    import transformers

    from cua_rl.areal.positions import fix_qwen2_5_vl_image_positions

    fix_qwen2_5_vl_image_positions()
    arch = transformers.AutoConfig.from_pretrained(model_dir).architectures[0]
    cls = getattr(transformers, arch)
    return cls.from_pretrained(model_dir, dtype=torch.float32).eval()


def next_token_logprobs(
    model,
    row: dict,
    *,
    temperature: float = 1.0,
    allowed: Sequence[int] | None = None,
    banned: Sequence[int] | None = None,
):
    import torch

    mm = row["multi_modal_input"][0]
    with torch.no_grad():
        logits = (
            model(
                input_ids=row["input_ids"],
                attention_mask=row["attention_mask"].long(),
                pixel_values=mm["pixel_values"],
                image_grid_thw=mm["image_grid_thw"],
                mm_token_type_ids=row["mm_token_type_ids"],
            )
            .logits[0]
            .float()
            / temperature
        )
    if allowed is not None:
        keep = torch.full_like(logits, float("-inf"))
        keep[:, list(allowed)] = logits[:, list(allowed)]
        logits = keep
    if banned:
        logits[:, list(banned)] = float("-inf")
    logp = torch.log_softmax(logits, dim=-1)
    ids = row["input_ids"][0]
    out = torch.zeros(len(ids))
    out[1:] = logp[:-1].gather(-1, ids[1:, None])[:, 0]
    return out


def trained_gap(model, row: dict, **kwargs):
    """|forward logprob - recorded logprob| on every trained token of ``row``; an episode's
    batch of several rows (``ConversionResult.row``) is taken row by row, gaps in row order."""
    import torch

    from cua_rl.trajectory.rows import unstack_rows

    if row["input_ids"].shape[0] > 1:
        return torch.cat([trained_gap(model, r, **kwargs) for r in unstack_rows(row)])
    pos = row["loss_mask"][0].nonzero().flatten()
    if not len(pos):
        raise ValueError("the row has no trained token")
    return (next_token_logprobs(model, row, **kwargs)[pos] - row["logprobs"][0, pos]).abs()
