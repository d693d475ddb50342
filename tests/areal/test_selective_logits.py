"""Selective logits give AReaL's FSDP actor the same results as its own full-logits path.

Two real AReaL actors side by side on CPU (one process, gloo): AReaL's ``FSDPPPOActor`` and
``SelectiveLogitsPPOActor``, loaded from the same tiny Qwen2-VL, fed the same packed
micro-batches that mix screenshot-heavy and text-only rows, driven through the calls the
trainer makes on a worker. The memory test runs bench/row_memory.py's measurement on the
production-width vocabulary.
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cua_rl.areal import logits as sel
from cua_rl.areal import logits_engine as eng
from cua_rl.areal import support
from cua_rl.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


# -- planning (pure) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mask", "expected"),
    [
        # Two sampled spans: each span, plus the position before it (its first token's logprob).
        ([0, 0, 1, 1, 0, 0, 1, 0], [1, 2, 3, 5, 6]),
        # A mask already shifted left by one (what ppo_update passes) keeps the same rows.
        ([0, 1, 1, 0, 0, 1, 0, 0], [0, 1, 2, 4, 5]),
        # A span that ends the row: nothing wraps around except position 0's successor rule.
        ([0, 0, 0, 1, 1], [2, 3, 4]),
        # Nothing to train: one row anyway, so the head still has an output.
        ([0, 0, 0, 0], [0]),
    ],
)
def test_loss_positions(mask, expected):
    assert eng.loss_positions(torch.tensor([mask])).tolist() == expected


def test_loss_positions_wraps_onto_the_first_token_of_a_packed_row():
    # Position 0 being in the mask makes the last position "followed by" it through the roll;
    # keeping one extra row is harmless, dropping one would not be.
    assert eng.loss_positions(torch.tensor([1, 0, 0, 0])).tolist() == [0, 3]


def test_config_refuses_non_booleans():
    with pytest.raises(ConfigError, match="true or false"):
        sel.LogitsConfig(selective="yes")


def test_trainer_class_follows_the_switch():
    from areal import PPOTrainer

    from cua_rl.areal import actor

    # Off: AReaL's actor unchanged, made from our class (whose module applies the fixes).
    assert sel.trainer_class(sel.LogitsConfig(selective=False)) is actor.CuaTrainer
    assert actor.CuaTrainer.actor_class is actor.CuaPPOActor
    assert sel.trainer_class(sel.LogitsConfig()) is eng.SelectiveLogitsTrainer
    assert eng.SelectiveLogitsTrainer.actor_class is eng.SelectiveLogitsPPOActor
    assert issubclass(eng.SelectiveLogitsPPOActor, actor.CuaPPOActor)
    assert issubclass(eng.SelectiveLogitsTrainer, PPOTrainer)


class _LoaderTrainer:
    """Stands for a PPOTrainer subclass of the project's (a trainer with its own data loader)."""


def test_a_trainer_subclass_gets_selective_logits_in_front():
    from areal import PPOTrainer

    from cua_rl.areal.actor import ActorMixin

    base = type("LoaderTrainer", (_LoaderTrainer, PPOTrainer), {})
    plain = sel.trainer_class(sel.LogitsConfig(selective=False), base)
    assert issubclass(plain, base) and issubclass(plain, ActorMixin)
    assert not issubclass(plain, eng.SelectiveLogitsMixin)
    cls = sel.trainer_class(sel.LogitsConfig(), base)
    assert issubclass(cls, base) and issubclass(cls, eng.SelectiveLogitsMixin)
    # Our engine factory first, then the subclass's own methods, then AReaL's.
    assert cls.__mro__.index(eng.SelectiveLogitsMixin) < cls.__mro__.index(base)
    assert sel.trainer_class(sel.LogitsConfig(), base) is cls  # one class per base
    assert eng.with_selective_logits(cls) is cls
    with pytest.raises(TypeError, match="not a PPOTrainer"):
        eng.with_selective_logits(_LoaderTrainer)


def test_another_areal_release_is_refused(monkeypatch):
    assert support.areal_version() == support.SUPPORTED_AREAL
    monkeypatch.setattr(support, "areal_version", lambda: "1.0.5")
    with pytest.raises(ConfigError, match="logits.selective=false"):
        sel.trainer_class(sel.LogitsConfig())
    # Switched off, no override mirrors an AReaL method body: the release check does not apply
    # (check_areal still looks up the trainer factory the actor class goes through).
    sel.trainer_class(sel.LogitsConfig(selective=False))


# -- two real actors ---------------------------------------------------------------------------

TEMPERATURE = 0.8


def _rows(vocab_size: int) -> list[dict]:
    from cua_rl.testing.actor import screenshot_row

    shapes = [  # (turns, screenshots): groups of 2 for the group-normalised rewards
        (4, True),
        (2, False),
        (5, True),
        (1, False),
        (3, True),
        (3, False),
    ]
    return [
        screenshot_row(
            turns,
            vocab_size=vocab_size,
            screenshots=shots,
            image_tokens=16,
            prompt_tokens=12,
            sampled_tokens=6,
            seed=i,
        )
        for i, (turns, shots) in enumerate(shapes)
    ]


@pytest.fixture(scope="module")
def actors(tiny_vl_model_dir):
    from areal.engine.fsdp_engine import FSDPPPOActor
    from areal.utils import stats_tracker
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from cua_rl.areal.attention import keep_packed_sequences_apart
    from cua_rl.testing.actor import actor_config, make_actor

    # As in a CPU worker: SDPA that keeps packed rows apart.
    original_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    keep_packed_sequences_apart()
    # ~450 tokens per micro-batch: the six rows (about 1,000 tokens) pack into three
    # micro-batches of several rows each.
    config = actor_config(tiny_vl_model_dir, temperature=TEMPERATURE)
    config.mb_spec.max_tokens_per_mb = 450
    full = make_actor(FSDPPPOActor, copy.deepcopy(config))
    selective = make_actor(eng.SelectiveLogitsPPOActor, copy.deepcopy(config))
    stats_tracker.export_all()  # start from an empty tracker
    yield full, selective
    # The first actor created the process group: it goes last.
    for actor in (selective, full):
        actor.destroy()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = original_sdpa


@pytest.fixture(scope="module")
def vocab(actors):
    return actors[0].model.get_output_embeddings().weight.shape[0]


class HeadRows:
    """Records how many rows each call of the LM head produced."""

    def __init__(self, actor):
        self.rows: list[int] = []
        head = actor.model.get_output_embeddings()
        self.handle = head.register_forward_hook(lambda m, a, out: self.rows.append(out.shape[-2]))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _planned_rows(rows: list[dict]) -> int:
    return sum(eng.loss_positions(r["loss_mask"]).numel() for r in rows)


def _close(a: float, b: float, rel: float = 1e-5, abs_: float = 1e-7) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b)) + abs_


@pytest.mark.slow
def test_compute_logp_is_the_same_at_every_loss_position(actors, vocab):
    full, selective = actors
    rows = _rows(vocab)
    expected = full.compute_logp(copy.deepcopy(rows))
    with HeadRows(selective) as head:
        got = selective.compute_logp(copy.deepcopy(rows))
    # The head really ran on the planned rows only, over several packed micro-batches.
    assert len(head.rows) >= 2
    assert sum(head.rows) == _planned_rows(rows) < sum(r["input_ids"].shape[1] for r in rows) / 2
    for row, want, have in zip(rows, expected, got, strict=True):
        # logprobs[i] belongs to token i + 1: the loss reads them where the next token is sampled.
        read = torch.roll(row["loss_mask"], shifts=-1, dims=-1).bool()
        assert want.shape == have.shape
        assert (want[read] != 0).all()
        assert (want[read] - have[read]).abs().max().item() < 1e-6


@pytest.mark.slow
def test_forward_without_a_loss_mask_falls_back_to_every_position(actors, vocab):
    full, selective = actors
    rows = [{k: v for k, v in r.items() if k != "loss_mask"} for r in _rows(vocab)[:2]]
    expected = full.compute_logp(copy.deepcopy(rows))
    with HeadRows(selective) as head:
        got = selective.compute_logp(copy.deepcopy(rows))
    # AReaL's path: every position of the packed micro-batch, its padding included.
    assert sum(head.rows) >= sum(r["input_ids"].shape[1] for r in rows)
    for want, have in zip(expected, got, strict=True):
        assert (want - have).abs().max().item() < 1e-6


def _stale_proximal(full, rows: list[dict]) -> list[dict]:
    """Rows with AReaL's recomputed logprobs, made a little stale, as the proximal policy.

    At the current weights the importance ratio is exactly 1 and the batch-normalised
    advantages make the loss 0; a seeded shift gives ratios that clip and a loss that does not
    vanish. Both actors get these same rows, so their losses differ if their logprobs do.
    """
    rows = copy.deepcopy(rows)
    gen = torch.Generator().manual_seed(7)
    for row, logp in zip(rows, full.compute_logp(rows), strict=True):
        row["prox_logp"] = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    return rows


def _advantage_batches(actors, vocab: int) -> list[tuple]:
    """Each actor with its ``compute_advantages`` output for the same stale-proximal rows."""
    rows = _stale_proximal(actors[0], _rows(vocab))
    return [(actor, actor.compute_advantages(copy.deepcopy(rows))) for actor in actors]


def _grads(actor) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().clone() for n, p in actor.model.named_parameters() if p.grad is not None
    }


@pytest.mark.slow
def test_ppo_update_gives_the_same_gradients_and_statistics(actors, vocab):
    results = []
    for actor, batch in _advantage_batches(actors, vocab):
        actor.export_stats()  # drop what compute_logp and earlier tests recorded
        actor.ppo_update(batch)  # lr 0: the weights stay as loaded
        results.append((_grads(actor), actor.export_stats()))
    (grads_full, stats_full), (grads_sel, stats_sel) = results

    assert grads_full.keys() == grads_sel.keys() and len(grads_full) > 10
    for name, want in grads_full.items():
        diff = (want - grads_sel[name]).norm() / want.norm().clamp_min(1e-30)
        assert diff.item() < 1e-5, name
    assert stats_full["ppo_actor/update/grad_norm"] > 0
    assert stats_full["ppo_actor/update/clip_ratio/avg"] > 0

    # Every statistic AReaL logs, the ones read off the logits included (cua-rl's actor adds its
    # vision tower's counts, docs/vision.md).
    stats_sel = {k: v for k, v in stats_sel.items() if not k.startswith("cua_vision/")}
    assert stats_full.keys() == stats_sel.keys()
    for key in (
        "entropy/avg",
        "vocab_min_logits/min",
        "vocab_max_logits/max",
        "actor_loss/avg",
        "importance_weight/avg",
        "new_logp/avg",
        "clip_ratio/avg",
    ):
        assert f"ppo_actor/update/{key}" in stats_full, key
    differing = {k: (v, stats_sel[k]) for k, v in stats_full.items() if not _close(v, stats_sel[k])}
    assert differing == {}


@pytest.mark.slow
def test_loss_is_the_same(actors, vocab):
    from areal.trainer.ppo.actor import grpo_loss_fn

    losses = []
    for actor, batch in _advantage_batches(actors, vocab):
        loss = actor.eval_batch(
            batch,
            loss_fn=functools.partial(
                grpo_loss_fn, eps_clip=0.2, eps_clip_higher=None, c_clip=None
            ),
            loss_weight_fn=lambda mb: mb["loss_mask"].count_nonzero(),
        )
        actor.export_stats()
        losses.append(float(loss))
    assert losses[0] != 0
    assert _close(losses[0], losses[1], abs_=0.0), losses


# -- memory on the production vocabulary -------------------------------------------------------


def _bench_child(mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "bench/row_memory.py", "--child", mode, "--turns", "5", "--repeat", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_five_screenshot_row_trains_in_less_memory():
    from cua_rl.testing.models import WIDE_VOCAB

    full, selective = _bench_child("areal"), _bench_child("selective")
    assert full["tokens"] == selective["tokens"] and full["trained"] == selective["trained"]
    # The same step: same gradient norm and entropy.
    assert _close(full["grad_norm"], selective["grad_norm"])
    assert _close(full["entropy"], selective["entropy"])
    # AReaL's step holds fp32 logits (and their gradient) for every row; ours for the trained
    # spans (one extra row each, 5 turns) plus a 256-row transient for the statistics. Require
    # at least one logits tensor's worth of the rows that carry no loss to be saved.
    skipped_rows = full["tokens"] - (full["trained"] + 5)
    assert skipped_rows > full["tokens"] / 2
    row_bytes = WIDE_VOCAB * 4
    assert full["update_added"] - selective["update_added"] > skipped_rows * row_bytes
    assert full["logp_added"] > selective["logp_added"]
