"""The actor's side of step credit: AReaL's advantages, each token's step advantage added before
AReaL's normalisation.

What AReaL 1.0.4 computes after the group filter (``PPOActor._compute_advantages``,
areal/trainer/ppo/actor.py), and why each part would undo step credit if left alone:

- **GAE** puts a row's scalar reward (``rewards``, the episode's group-normalised advantage) on
  its last token and runs the GAE recursion back over the row's trained tokens. With no critic
  (values 0), ``discount`` 1 and ``gae_lambda`` 1 every trained token of the row gets exactly
  that scalar: a row spanning every step of an append-only agent gives every step the same
  advantage, whatever the filter meant per step. A per-token value cannot be passed through it.
- **adv_norm** at batch level (``Normalization``, token-weighted over the loss mask) centres
  and scales the whole batch's advantages. Applied to the episode advantages alone and followed
  by an unscaled step term it would change the weight between the two (``w``); at group level it
  slices fixed chunks of rows (refused by the config in any case).

So ``advantages_with_steps`` runs AReaL's own computation with the normalisation held back,
adds each token's step advantage (the row's ``step_advantages``, shifted by one position as
AReaL shifts the loss mask: position t trains token t+1), then applies AReaL's own normaliser to
the sum, as AReaL would have to its advantages. The config refuses what would break the first
point (``actor.discount`` or ``gae_lambda`` below 1, a reward scaling or bias, rows without EOS
zeroed) when step credit is on.
"""

from __future__ import annotations

from typing import Any

from cua_rl.credit.advantages import STEP_ADVANTAGES


def advantages_with_steps(actor: Any, data: dict[str, Any]) -> dict[str, Any]:
    """AReaL's ``actor._compute_advantages(data)`` (``actor``: its ``PPOActor``) on a batch
    whose rows carry ``STEP_ADVANTAGES``: their values added to each trained token's advantage
    before AReaL's ``adv_norm``."""
    import torch

    steps = data.pop(STEP_ADVANTAGES)
    norm = actor.adv_norm
    actor.adv_norm = None
    try:
        data = actor._compute_advantages(data)
    finally:
        actor.adv_norm = norm
    # data["loss_mask"] is AReaL's, already rolled by -1.
    extra = torch.roll(steps.to(data["advantages"]), shifts=-1, dims=-1) * data["loss_mask"]
    advantages = data["advantages"] + extra
    data["returns"] = data["returns"] + extra
    if norm is not None:
        advantages = norm(advantages, data["loss_mask"])
    data["advantages"] = advantages
    return data


def carries_steps(rows: list[dict[str, Any]]) -> bool:
    """Whether a batch's rows carry step advantages (all or none: the group filter adds them to
    every accepted group while step credit is on; a batch mixing both is refused)."""
    have = [STEP_ADVANTAGES in row for row in rows]
    if any(have) and not all(have):
        raise ValueError(
            f"{sum(have)} of {len(rows)} rows carry {STEP_ADVANTAGES}: every group the trainer "
            "gets passes the group filter, which adds them to all while step_credit is on"
        )
    return all(have) and bool(have)
