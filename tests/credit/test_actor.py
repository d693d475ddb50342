"""Step advantages through the real actor: AReaL's ``FSDPPPOActor`` and ``CuaPPOActor`` on CPU
(one process, gloo, fp32), the trainer's calls in its order (``compute_logp``,
``compute_advantages``, ``ppo_update``) on the rows of two episodes, in both layouts: one
append-only row per episode spanning its 4 steps, and MAI-UI's window (one row per call).

What AReaL alone does with the group filter's output: its GAE (no critic, discount 1) gives
every trained token of a row the row's reward, so the 4 steps of an append-only row come out
equal whatever the filter meant. The test computes what each token's advantage must be by hand
(the row's reward plus its step's advantage, then AReaL's batch normalisation written out:
token-weighted mean, unbiased std, eps) and checks the actor's, and that the loss sees them: a
``ppo_update`` on the actor's batch gives the gradients of one on a batch whose advantages were
set to the hand-computed values, and not those of episode credit alone.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cua_rl.credit.advantages import STEP_ADVANTAGES
from cua_rl.credit.steps import runs

pytestmark = pytest.mark.slow
EPS = 1e-5  # AReaL's NormConfig default, the actor config's adv_norm
# Per episode (seed 1, seed 2) its reward (the group filter's episode advantage) and its 4 steps'
# advantages (the filter's weight times each step's), made up.
EPISODES = {1: (0.8, [0.5, -0.25, 0.0, 1.0]), 2: (-0.8, [-0.5, 0.25, 0.0, -1.0])}


@pytest.fixture(scope="module")
def actors():
    from areal.engine.fsdp_engine import FSDPPPOActor
    from areal.utils import stats_tracker
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from cua_rl.areal.actor import CuaPPOActor
    from cua_rl.testing.actor import actor_config, make_actor
    from cua_rl.testing.cache import ensure_model

    original_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    model_dir = ensure_model("qwen2-vl-byte")
    # As cua-rl trains: the group filter normalised the rewards; AReaL's reward_norm is off.
    config = actor_config(model_dir, temperature=0.8, reward_norm=None)
    areal = make_actor(FSDPPPOActor, copy.deepcopy(config))
    ours = make_actor(CuaPPOActor, copy.deepcopy(config))
    stats_tracker.export_all()
    yield areal, ours, model_dir
    ours.destroy()
    areal.destroy()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = original_sdpa


def _rows(actors, window: int | None) -> list[dict]:
    """Two episodes of 4 steps; each row's reward is its episode's, and its sampled tokens
    carry their step's advantage (the k-th run of sampled tokens of an episode is step k)."""
    from cua_rl.testing.actor import vision_geometry, window_rows

    areal, _, model_dir = actors
    vocab = areal.model.get_output_embeddings().weight.shape[0]
    patch_dim, merge = vision_geometry(model_dir)
    rows = []
    for seed, (reward, steps) in EPISODES.items():
        own = window_rows(
            4, window=window, vocab_size=vocab, patch_dim=patch_dim, merge=merge, seed=seed
        )
        step = 0
        for row in own:
            row["rewards"] = torch.tensor([reward])
            adv = torch.zeros(row["input_ids"].shape, dtype=torch.float32)
            for start, end in runs(row["loss_mask"][0].tolist()):
                adv[0, start:end] = steps[step]
                step += 1
            row[STEP_ADVANTAGES] = adv
        assert step == 4
        rows += own
    return rows


def _expected(rows: list[dict]) -> list[torch.Tensor]:
    """Each row's advantages, by hand: at position t (which trains token t+1), the row's reward
    plus token t+1's step advantage; then the batch's masked mean and unbiased std."""
    raw, masks = [], []
    for row in rows:
        mask = torch.roll(row["loss_mask"][0].float(), -1)
        value = (row["rewards"][0] + torch.roll(row[STEP_ADVANTAGES][0], -1)) * mask
        raw.append(value)
        masks.append(mask)
    pool = torch.cat([v[m.bool()] for v, m in zip(raw, masks, strict=True)]).double()
    mean, std = pool.mean(), pool.std(unbiased=True)
    return [((v - mean) * m / (std + EPS)).float() for v, m in zip(raw, masks, strict=True)]


def _with_prox(actors, rows: list[dict]) -> list[dict]:
    """The rows with AReaL's recomputed proximal logprobs (the trainer's first call), which must
    be the same with and without the step advantages in the rows."""
    areal, ours, _ = actors
    bare = [{k: v for k, v in r.items() if k != STEP_ADVANTAGES} for r in rows]
    want = areal.compute_logp(copy.deepcopy(bare))
    got = ours.compute_logp(copy.deepcopy(rows))
    gen = torch.Generator().manual_seed(7)
    for row, w, g in zip(rows, want, got, strict=True):
        assert torch.allclose(w, g, atol=1e-6)
        # A stale proximal policy, so the loss does not vanish.
        row["prox_logp"] = w + 0.3 * torch.randn(w.shape, generator=gen)
    return rows


def _grads(actor) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().clone() for n, p in actor.model.named_parameters() if p.grad is not None
    }


def _update(actor, batch: list[dict]) -> dict[str, torch.Tensor]:
    actor.export_stats()
    actor.ppo_update(copy.deepcopy(batch))
    actor.export_stats()
    return _grads(actor)


def _diff(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).norm() / a[n].norm().clamp_min(1e-30)).item() for n in a)


@pytest.mark.parametrize("window", [None, 3], ids=["append-only", "mai-ui"])
def test_each_steps_tokens_carry_its_advantage_into_the_loss(actors, window):
    areal, ours, _ = actors
    rows = _with_prox(actors, _rows(actors, window))
    expected = _expected(rows)
    batch = ours.compute_advantages(copy.deepcopy(rows))
    assert all(STEP_ADVANTAGES not in row for row in batch)
    for row, want in zip(batch, expected, strict=True):
        assert torch.allclose(row["advantages"][0], want, atol=1e-5)
    bare = [{k: v for k, v in r.items() if k != STEP_ADVANTAGES} for r in rows]
    theirs = areal.compute_advantages(copy.deepcopy(bare))
    if window is None:
        # One row holds an episode's 4 steps: ours gives them 4 values (the 4 step advantages
        # differ), AReaL alone one (the row's reward).
        for mine, row in zip(batch, theirs, strict=True):
            read = row["loss_mask"][0].bool()
            assert len(set(mine["advantages"][0][read].round(decimals=5).tolist())) == 4
            assert len(set(row["advantages"][0][read].round(decimals=5).tolist())) == 1
    # The loss sees them: the same gradients as a batch whose advantages are set by hand...
    by_hand = copy.deepcopy(theirs)
    for row, want in zip(by_hand, expected, strict=True):
        row["advantages"] = want.unsqueeze(0)
    want_grads = _update(areal, by_hand)
    got_grads = _update(ours, batch)
    assert _diff(want_grads, got_grads) < 1e-4
    # ...and not those of episode credit alone.
    episode_only = _update(areal, theirs)
    assert _diff(want_grads, episode_only) > 1e-2


def test_a_batch_mixing_rows_with_and_without_step_advantages_is_refused(actors):
    _, ours, _ = actors
    rows = _with_prox(actors, _rows(actors, 3))
    del rows[0][STEP_ADVANTAGES]
    with pytest.raises(ValueError, match="1 of 8 rows|7 of 8 rows"):
        ours.compute_advantages(rows)
