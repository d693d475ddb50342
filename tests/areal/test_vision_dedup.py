"""Each distinct screenshot through the vision tower once gives AReaL's results.

Two real AReaL actors side by side on CPU (one process, gloo, fp32) for each Qwen-VL family:
AReaL's ``FSDPPPOActor`` and ``CuaPPOActor`` (``actor.vision.dedup`` on), loaded from the same
tiny model, fed the same MAI-UI-style rows (one per call, a 3-screenshot window) of two episodes.
A hook on each vision tower records what it encodes; AReaL's records the content of each image
it saw, from which the test counts the distinct ones itself.
"""

from __future__ import annotations

import copy
import hashlib
import itertools

import pytest
import torch

from cua_rl.areal import vision_dedup as vd
from cua_rl.areal.packing import sequential_allocate
from cua_rl.areal.vision import (
    CuaActorConfig,
    VisionSection,
    vision_packing_warning,
    vision_section,
)
from cua_rl.errors import ConfigError, CuaRlError
from cua_rl.testing.logs import LogLines

FAMILIES = ("qwen2-vl-byte", "qwen2.5-vl", "qwen3-vl")
TEMPERATURE = 0.8
ONE_MB = 1 << 20
SEVERAL_MBS = 260  # tokens per micro-batch: the 8 rows (~100 tokens each) go into several


# -- planning (pure) ---------------------------------------------------------------------------


def _media(keys: list[int], pixels: dict[int, torch.Tensor], side: int = 4) -> dict:
    return {
        "pixel_values": torch.cat([pixels[k] for k in keys]),
        "image_grid_thw": torch.tensor([[1, side, side]] * len(keys)),
        "image_keys": torch.tensor(keys, dtype=torch.long),
    }


def test_plan_images_encodes_each_key_once_and_maps_every_span():
    gen = torch.Generator().manual_seed(0)
    pixels = {k: torch.randn(16, 3, generator=gen) for k in (10, 20, 30, 40)}
    rows = [_media([10, 20, 30], pixels), {}, _media([20, 30, 40], pixels), _media([30], pixels)]
    plan = vd.plan_images(rows, merge=2)
    assert (plan.images, plan.distinct) == (7, 4)
    # First-seen order: 10, 20, 30, 40; each holds 16 / 2^2 = 4 merged tokens.
    assert torch.equal(plan.pixel_values, torch.cat([pixels[k] for k in (10, 20, 30, 40)]))
    assert plan.grid.tolist() == [[1, 4, 4]] * 4
    spans = [0, 1, 2, 1, 2, 3, 2]
    assert plan.token_index.tolist() == [4 * d + i for d in spans for i in range(4)]


def test_without_a_repeat_the_plan_has_no_index_the_tower_output_is_read_in_order():
    """Rows of the current screenshot only: nothing to share, so no gather of the tower's output
    (and no scatter of its gradient) is planned."""
    gen = torch.Generator().manual_seed(0)
    pixels = {k: torch.randn(16, 3, generator=gen) for k in (10, 20, 30)}
    rows = [_media([10], pixels), {}, _media([20], pixels), _media([30], pixels)]
    plan = vd.plan_images(rows, merge=2)
    assert (plan.images, plan.distinct, plan.token_index) == (3, 3, None)
    assert torch.equal(plan.pixel_values, torch.cat([pixels[k] for k in (10, 20, 30)]))


def test_plan_images_refuses_one_key_for_two_images():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 3, generator=gen), torch.randn(16, 3, generator=gen)
    rows = [_media([7], {7: a}), _media([7], {7: b})]
    with pytest.raises(vd.ImageIdentityError, match="image key 7"):
        vd.plan_images(rows, merge=2)


def test_no_images_no_plan():
    assert vd.plan_images([{}, {"image_grid_thw": torch.zeros(0, 3, dtype=torch.long)}], 2) is None


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"image_grid_thw": torch.ones(2, 3, dtype=torch.long)}, "without image identity"),
        (
            {
                "image_grid_thw": torch.ones(2, 3, dtype=torch.long),
                "image_keys": torch.tensor([1]),
            },
            "without image identity",
        ),
        ({"video_grid_thw": torch.ones(1, 3, dtype=torch.long)}, "video"),
    ],
)
def test_batch_reason(row, reason):
    assert reason in vd.batch_reason([{}, row])


def test_batch_reason_accepts_rows_with_keys_and_rows_without_images():
    assert vd.batch_reason([{}, _media([1], {1: torch.zeros(16, 3)})]) == ""


def test_vision_config():
    assert vision_section(CuaActorConfig()).dedup is True
    assert vision_section(CuaActorConfig()).freeze is False
    from areal.api.cli_args import PPOActorConfig

    assert vision_section(PPOActorConfig()) == VisionSection()  # a reference model's engine
    with pytest.raises(ConfigError, match="actor.vision.freeze must be true or false"):
        VisionSection(freeze="yes")


@pytest.mark.parametrize(
    ("values", "min_groups", "divisor", "expected"),
    [
        # Filled in order up to the capacity (6), never reordered by length.
        ([3, 3, 3, 3], None, 1, [[0, 1], [2, 3]]),
        ([1, 5, 1, 5, 2], None, 1, [[0, 1], [2, 3], [4]]),
        # At least 3 groups: the fullest is halved (ties: the first).
        ([3, 3, 3, 3], 3, 1, [[0], [1], [2, 3]]),
        # 3 groups, divisor 2: one more.
        ([1, 5, 1, 5, 2], None, 2, [[0], [1], [2, 3], [4]]),
    ],
)
def test_sequential_allocate(values, min_groups, divisor, expected):
    assert sequential_allocate(values, 6, min_groups, divisor) == expected


def test_sequential_allocate_refuses_what_cannot_fit():
    with pytest.raises(CuaRlError, match="exceeds max_tokens_per_mb=6"):
        sequential_allocate([3, 7], 6, None)
    with pytest.raises(CuaRlError, match="2 rows cannot fill 3 micro-batches"):
        sequential_allocate([3, 3], 6, 3)


def test_several_ppo_minibatches_are_warned_about():
    config = CuaActorConfig(ppo_n_minibatches=2)
    assert "actor.ppo_n_minibatches=1" in vision_packing_warning(config)
    config.vision.pack_episodes = False
    assert vision_packing_warning(config) == ""
    assert vision_packing_warning(CuaActorConfig(ppo_n_minibatches=1)) == ""


# -- two real actors per family ----------------------------------------------------------------


class TowerCalls:
    """Per vision-tower call: the content hash of every image it was given."""

    def __init__(self, actor):
        self.calls: list[list[str]] = []
        tower = vd.vision_tower(actor.model)
        self.handle = tower.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs, output):
        grid = kwargs["grid_thw"]
        chunks = torch.split(args[0].detach(), grid.prod(-1).tolist())
        self.calls.append([hashlib.sha256(c.numpy().tobytes()).hexdigest() for c in chunks])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.fixture(scope="module", params=FAMILIES)
def actors(request):
    from areal.engine.fsdp_engine import FSDPPPOActor
    from areal.utils import stats_tracker
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from cua_rl.areal.actor import CuaPPOActor
    from cua_rl.areal.attention import keep_packed_sequences_apart
    from cua_rl.areal.logits_engine import SelectiveLogitsPPOActor
    from cua_rl.testing.actor import actor_config, make_actor
    from cua_rl.testing.cache import ensure_model

    original_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    keep_packed_sequences_apart()
    model_dir = ensure_model(request.param)
    config = actor_config(model_dir, temperature=TEMPERATURE)
    areal = make_actor(FSDPPPOActor, copy.deepcopy(config))
    # Deduplication in AReaL's micro-batches (its packer), so each call has a counterpart.
    unpacked = copy.deepcopy(config)
    unpacked.vision.pack_episodes = False
    dedup = make_actor(CuaPPOActor, unpacked)
    # The two switches alone: selective logits with deduplication, deduplication off.
    selective = make_actor(SelectiveLogitsPPOActor, copy.deepcopy(config))
    off = copy.deepcopy(config)
    off.vision.dedup = False
    plain = make_actor(CuaPPOActor, off)
    packed = make_actor(CuaPPOActor, copy.deepcopy(config))  # the defaults: rows in order
    stats_tracker.export_all()
    yield areal, dedup, model_dir, selective, plain, packed
    # The first actor created the process group: it goes last.
    for actor in (packed, plain, selective, dedup, areal):
        actor.destroy()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = original_sdpa


def _rows(actors) -> list[dict]:
    """Two episodes of 4 calls, MAI-UI's window (3 screenshots): 8 rows, 18 images (1 + 2 + 3 + 3 each), 8 distinct."""
    from cua_rl.testing.actor import group_rows, vision_geometry

    areal, _, model_dir, *_ = actors
    vocab = areal.model.get_output_embeddings().weight.shape[0]
    patch_dim, merge = vision_geometry(model_dir)
    return group_rows(4, window=3, vocab_size=vocab, patch_dim=patch_dim, merge=merge)


def _set_mb_tokens(actors, tokens: int) -> None:
    for actor in (actors[0], actors[1], *actors[3:]):
        actor.config.mb_spec.max_tokens_per_mb = tokens


def _logp_diff(rows, expected, got) -> float:
    worst = 0.0
    for row, want, have in zip(rows, expected, got, strict=True):
        read = torch.roll(row["loss_mask"], shifts=-1, dims=-1).bool()
        assert want.shape == have.shape and (want[read] != 0).all()
        worst = max(worst, (want[read] - have[read]).abs().max().item())
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("mb_tokens", [ONE_MB, SEVERAL_MBS], ids=["one-mb", "several-mbs"])
def test_compute_logp_is_areals_and_the_tower_sees_distinct_images(actors, mb_tokens):
    areal, dedup, *_ = actors
    _set_mb_tokens(actors, mb_tokens)
    rows = _rows(actors)
    with TowerCalls(areal) as seen:
        expected = areal.compute_logp(copy.deepcopy(rows))
    with TowerCalls(dedup) as encoded:
        got = dedup.compute_logp(copy.deepcopy(rows))
    assert sum(len(c) for c in seen.calls) == 18
    # One tower call per micro-batch, as AReaL's path; each on that micro-batch's distinct
    # images, counted from what AReaL's tower was given.
    assert len(encoded.calls) == len(seen.calls) >= (1 if mb_tokens == ONE_MB else 3)
    assert [len(c) for c in encoded.calls] == [len(set(c)) for c in seen.calls]
    assert all(len(set(c)) == len(c) for c in encoded.calls)
    if mb_tokens == ONE_MB:
        assert [len(c) for c in encoded.calls] == [8]
    assert _logp_diff(rows, expected, got) < 1e-6
    stats = dedup.export_stats()
    assert stats["cua_vision/row_images"] == 18
    assert stats["cua_vision/distinct_images"] == sum(len(c) for c in encoded.calls)
    assert stats["cua_vision/encoded_images"] == sum(len(c) for c in encoded.calls)


@pytest.mark.slow
def test_current_screenshot_rows_are_areals_with_no_gather_of_the_tower_output(actors):
    """Every image distinct (one screenshot per row): AReaL's logprobs and gradients, and no
    indexing operator beyond AReaL's own in the step (the tower's output is used in order)."""
    from cua_rl.testing.actor import group_rows, vision_geometry

    areal, dedup, model_dir, *_ = actors
    _set_mb_tokens(actors, ONE_MB)
    vocab = areal.model.get_output_embeddings().weight.shape[0]
    patch_dim, merge = vision_geometry(model_dir)
    rows = group_rows(4, window=1, vocab_size=vocab, patch_dim=patch_dim, merge=merge)
    for row, logp in zip(rows, areal.compute_logp(copy.deepcopy(rows)), strict=True):
        row["prox_logp"] = logp + 0.3
    indexing = {}
    for name, actor in (("areal", areal), ("dedup", dedup)):
        got = actor.compute_logp(copy.deepcopy(rows))
        assert _logp_diff(rows, [r["prox_logp"] - 0.3 for r in rows], got) < 1e-6
        batch = actor.compute_advantages(copy.deepcopy(rows))
        actor.export_stats()
        with torch.profiler.profile() as prof:
            actor.ppo_update(batch)
        indexing[name] = sum(
            e.count for e in prof.key_averages() if e.key in ("aten::index", "aten::index_put_")
        )
        indexing[name + " grads"] = _grads(actor)
    stats = dedup.export_stats()
    assert stats["cua_vision/encoded_images"] == stats["cua_vision/row_images"] == 8
    _assert_same_grads(indexing["areal grads"], indexing["dedup grads"])
    assert indexing["dedup"] == indexing["areal"], indexing


@pytest.mark.slow
def test_negative_control_a_wrong_image_mapping_changes_the_logprobs(actors, monkeypatch):
    areal, dedup, *_ = actors
    _set_mb_tokens(actors, ONE_MB)
    rows = _rows(actors)
    expected = areal.compute_logp(copy.deepcopy(rows))
    plan_images = vd.plan_images

    def swapped(media, merge):
        # Every span reads the next distinct image (same shapes, wrong content).
        plan = plan_images(media, merge)
        size = plan.token_index.numel() // plan.images
        plan.token_index = (plan.token_index + size) % (size * plan.distinct)
        return plan

    monkeypatch.setattr(vd, "plan_images", swapped)
    got = dedup.compute_logp(copy.deepcopy(rows))
    dedup.export_stats()
    assert _logp_diff(rows, expected, got) > 1e-4


def _grads(actor) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().clone() for n, p in actor.model.named_parameters() if p.grad is not None
    }


def _update(actors, others) -> list[tuple[dict, dict]]:
    """AReaL's actor, then each of ``others``: gradients and statistics of one ``ppo_update``
    (lr 0) on the same rows with a stale proximal policy (so the loss does not vanish)."""
    areal = actors[0]
    _set_mb_tokens(actors, SEVERAL_MBS)
    rows = copy.deepcopy(_rows(actors))
    gen = torch.Generator().manual_seed(7)
    for row, logp in zip(rows, areal.compute_logp(copy.deepcopy(rows)), strict=True):
        row["prox_logp"] = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    results = []
    for actor in (areal, *others):
        batch = actor.compute_advantages(copy.deepcopy(rows))
        actor.export_stats()
        actor.ppo_update(batch)
        results.append((_grads(actor), actor.export_stats()))
    return results


def _assert_same_grads(want: dict, have: dict) -> None:
    assert want.keys() == have.keys()
    vision = [n for n in want if ".visual." in n]
    assert len(vision) > 5 and all(want[n].norm() > 0 for n in vision)
    for name, g in want.items():
        diff = (g - have[name]).norm() / g.norm().clamp_min(1e-30)
        assert diff.item() < 1e-5, name


@pytest.mark.slow
def test_compute_advantages_gives_each_row_its_own_images(actors):
    """AReaL's hands every row a deep copy of the whole batch's ``multi_modal_input`` (rows x
    rows copies of the pixels); ours gives each row its own list, and AReaL's advantages."""
    areal, dedup, *_ = actors
    rows = _rows(actors)
    for row, logp in zip(rows, areal.compute_logp(copy.deepcopy(rows)), strict=True):
        row["prox_logp"] = logp
    theirs = areal.compute_advantages(copy.deepcopy(rows))
    assert [len(r["multi_modal_input"]) for r in theirs] == [len(rows)] * len(rows)
    given = copy.deepcopy(rows)
    ours = dedup.compute_advantages(given)
    areal.export_stats()
    dedup.export_stats()
    assert len(ours) == len(theirs) == len(rows)
    for sent, got, want in zip(given, ours, theirs, strict=True):
        assert got["multi_modal_input"] is sent["multi_modal_input"]
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[key], value), key


@pytest.mark.slow
def test_ppo_update_gives_areals_gradients_vision_included(actors):
    (want, stats_areal), (have, stats_dedup) = _update(actors, [actors[1]])
    _assert_same_grads(want, have)
    assert stats_dedup["cua_vision/encoded_images"] < stats_dedup["cua_vision/row_images"] == 18
    assert stats_areal["ppo_actor/update/grad_norm"] > 0


@pytest.mark.slow
def test_each_switch_alone(actors):
    """Selective logits with deduplication, and ``actor.vision.dedup=false``: AReaL's results;
    the tower encodes distinct images in the first, every row's in the second."""
    areal, _, _, selective, plain, _ = actors
    _set_mb_tokens(actors, ONE_MB)
    rows = _rows(actors)
    expected = areal.compute_logp(copy.deepcopy(rows))
    for actor, tower_images in ((selective, [8]), (plain, [18])):
        with TowerCalls(actor) as encoded:
            got = actor.compute_logp(copy.deepcopy(rows))
        assert [len(c) for c in encoded.calls] == tower_images
        assert _logp_diff(rows, expected, got) < 1e-6
        stats = actor.export_stats()
        assert stats["cua_vision/encoded_images"] == tower_images[0]
        # Rows with keys: the distinct images are counted whether or not the switch is on.
        assert (stats["cua_vision/row_images"], stats["cua_vision/distinct_images"]) == (18, 8)
    (want, _), (sel, _), (off, _) = _update(actors, [selective, plain])
    _assert_same_grads(want, sel)
    _assert_same_grads(want, off)


@pytest.mark.slow
def test_each_engine_fallback_names_its_reason(actors, monkeypatch):
    """Sequence parallelism, tree training, LoRA and the switch each send the rows down AReaL's
    path, and the reason says which (the rows' own reasons: ``test_batch_reason``)."""
    from areal.api.alloc_mode import ParallelStrategy
    from areal.engine.fsdp_utils.parallel import ParallelHelper

    dedup = actors[1]
    assert dedup._dedup_reason() == ""
    cases = [
        (
            "parallel_helper",
            dedup,
            ParallelHelper.from_parallel_strategy(ParallelStrategy(context_parallel_size=2)),
            "sequence parallelism (sp=2) splits the rows",
        ),
        ("enable_tree_training", dedup, True, "tree training packs shared prefixes"),
        ("use_lora", dedup.config, True, "LoRA wraps the model"),
        ("dedup", dedup.vision, False, "actor.vision.dedup is off"),
    ]
    for name, holder, value, reason in cases:
        with monkeypatch.context() as patch:
            patch.setattr(holder, name, value)
            assert dedup._dedup_reason() == reason
    assert dedup._dedup_reason() == ""


@pytest.mark.slow
def test_rows_without_image_identity_take_areals_path_with_one_log_line(actors):
    areal, dedup, *_ = actors
    _set_mb_tokens(actors, ONE_MB)
    rows = _rows(actors)
    for row in rows:
        del row["multi_modal_input"][0]["image_keys"]
    expected = areal.compute_logp(copy.deepcopy(rows))
    with LogLines(vd.log) as log, TowerCalls(dedup) as encoded:
        got = dedup.compute_logp(copy.deepcopy(rows))
        dedup.compute_logp(copy.deepcopy(rows))
    assert [len(c) for c in encoded.calls] == [18, 18]
    assert _logp_diff(rows, expected, got) < 1e-6
    assert [ln for ln in log.lines if "without image identity" in ln] == [
        "vision deduplication off for these rows: rows without image identity (image_keys "
        "with one key per image) (AReaL's path)"
    ]
    stats = dedup.export_stats()
    assert stats["cua_vision/encoded_images"] == stats["cua_vision/distinct_images"] == 36


@pytest.mark.slow
def test_episode_rows_packed_in_turn_order_encode_each_screenshot_about_once(actors):
    areal, dedup, *_, packed = actors
    _set_mb_tokens(actors, SEVERAL_MBS)
    rows = _rows(actors)
    # Each screenshot's place: (episode, step), from the rows themselves.
    place = {}
    for e in range(2):
        for t, row in enumerate(rows[4 * e : 4 * e + 4]):
            media = row["multi_modal_input"][0]
            last = torch.split(media["pixel_values"], media["image_grid_thw"].prod(-1).tolist())[-1]
            place[hashlib.sha256(last.numpy().tobytes()).hexdigest()] = (e, t)
    expected = areal.compute_logp(copy.deepcopy(rows))
    with TowerCalls(dedup) as scattered:
        dedup.compute_logp(copy.deepcopy(rows))
    with TowerCalls(packed) as in_order:
        got = packed.compute_logp(copy.deepcopy(rows))
    assert _logp_diff(rows, expected, got) < 1e-6
    assert len(in_order.calls) >= 3
    # The micro-batches follow the episodes' turns: each encodes its screenshots in (episode,
    # step) order and starts and ends no earlier than the one before; a cut re-encodes at most
    # the 2 screenshots the next row's window shares with the rows before it.
    calls = [[place[h] for h in call] for call in in_order.calls]
    assert all(c == sorted(c) for c in calls)
    for before, after in itertools.pairwise(calls):
        assert after[0] >= before[0] and after[-1] > before[-1]
        assert len(set(before) & set(after)) <= 2
    assert sorted({p for c in calls for p in c}) == sorted(place.values())
    encoded = sum(len(c) for c in in_order.calls)
    assert 8 <= encoded <= 8 + 2 * (len(in_order.calls) - 1)
    assert encoded < sum(len(c) for c in scattered.calls)
    packed.export_stats()
    dedup.export_stats()
