"""AReaL's FSDP PPO actor in this process on CPU, and screenshot-heavy rows for it to train on.

Tests and ``bench/row_memory.py`` drive the actor through the calls AReaL's trainer makes on a
worker (``compute_logp``, ``compute_advantages``, ``ppo_update``), with no scheduler, RPC or
inference server: a one-process gloo group (world size 1) is all ``FSDPEngine`` needs.

``screenshot_row`` lays a GUI episode out as the converter does, one row for all turns: per
turn a user prompt, optionally one screenshot (``<|vision_start|>``, image pads,
``<|vision_end|>`` with matching ``image_grid_thw``, random pixel patches and their content key),
then the sampled tokens, which alone are in the loss mask. ``window_rows`` lays an episode out as
an agent with a window of screenshots sends its calls, one row per call (MAI-UI: 3). Token ids and pixels come from a seeded generator.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
from typing import Any

import torch

from cua_rl.testing.models import SPECIAL_TOKENS, TOKEN_ID

# Qwen2-VL's vision geometry (the tiny models use the real one): 14-pixel patches, 2x2 merged
# into one image token, 2 frames per temporal patch, 3 channels.
_PATCH_DIM = 3 * 2 * 14 * 14
_MERGE = 2


def init_single_process_group() -> None:
    """Environment for a one-process torch.distributed group on a free loopback port.

    Values inherited from a parent process (which may hold that port) are replaced, unless this
    process already has its group. Its store and gloo listen on 127.0.0.1 only (torch's store
    would listen on every interface of the machine running the tests).
    """
    import torch.distributed as dist

    from cua_rl.cpu.loopback import torch_on_loopback

    if dist.is_initialized():
        return
    torch_on_loopback()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def actor_config(model_dir: str | os.PathLike, **overrides: Any):
    """A ``CuaActorConfig`` (AReaL's ``PPOActorConfig`` with ``vision``) for a CPU actor: fp32,
    sdpa, one minibatch, lr 0 unless overridden.

    The defaults mirror configs/cua.yaml's PPO settings (recomputed proximal logprobs,
    decoupled loss, group-normalised rewards in groups of 2, no KL term).
    """
    from areal.api.cli_args import MicroBatchSpec, NormConfig, OptimizerConfig

    from cua_rl.areal.vision import CuaActorConfig

    values: dict[str, Any] = dict(
        experiment_name="cpu-actor",
        trial_name="t",
        path=str(model_dir),
        backend="fsdp:d1",
        dtype="float32",
        attn_impl="sdpa",
        optimizer=OptimizerConfig(lr=0.0, weight_decay=0.0),
        ppo_n_minibatches=1,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=1 << 20),
        recompute_logprob=True,
        use_decoupled_loss=True,
        kl_ctl=0.0,
        reward_norm=NormConfig(mean_level="group", std_level="group", group_size=2),
        adv_norm=NormConfig(mean_level="batch", std_level="batch"),
        temperature=1.0,
    )
    values.update(overrides)
    return CuaActorConfig(**values)


def make_actor(engine_class: type, config: Any, *, dataset_size: int = 8):
    """Create, connect and initialise ``engine_class(config)`` as an AReaL worker would."""
    from areal.api.io_struct import FinetuneSpec

    init_single_process_group()
    actor = engine_class(config)
    actor.create_process_group()
    actor.initialize(
        None,
        FinetuneSpec(
            total_train_epochs=1, dataset_size=dataset_size, train_batch_size=dataset_size
        ),
    )
    return actor


def delivered(rows: Any) -> Any:
    """``rows`` as AReaL's RPC server hands them to an engine method: every tensor on the
    worker's current device (``engine_blueprint`` moves the arguments there before each call).
    A step driven in-process must do the same, or AReaL's own all-reduces (the advantage
    normalisation's) meet CPU tensors, which NCCL refuses."""
    from areal.utils.data import tensor_container_to

    return tensor_container_to(rows, worker_device())


def worker_device() -> Any:
    """The device AReaL's RPC server moves a call's arguments to."""
    from areal.infra.platforms import current_platform

    return current_platform.current_device()


def screenshot_row(
    turns: int,
    *,
    vocab_size: int,
    screenshots: bool = True,
    image_tokens: int = 64,
    prompt_tokens: int = 60,
    sampled_tokens: int = 40,
    seed: int = 0,
) -> dict[str, Any]:
    """One multi-turn training row in AReaL's trajectory format (batch dimension 1).

    ``image_tokens`` must be a square (the screenshot's grid of merged tokens). Sampled tokens
    carry made-up behaviour logprobs (negative), version 0 and a seeded reward in [0, 1).
    """
    side = math.isqrt(image_tokens)
    if side * side != image_tokens or side < 1:
        raise ValueError(f"image_tokens={image_tokens} must be a positive square, e.g. 64")
    gen = torch.Generator().manual_seed(seed)
    low = len(SPECIAL_TOKENS)
    ids: list[int] = []
    loss: list[int] = []
    pixels = []
    for _ in range(turns):
        prompt = torch.randint(low, vocab_size, (prompt_tokens,), generator=gen).tolist()
        ids += prompt
        loss += [0] * prompt_tokens
        if screenshots:
            ids += [TOKEN_ID["<|vision_start|>"]]
            ids += [TOKEN_ID["<|image_pad|>"]] * image_tokens
            ids += [TOKEN_ID["<|vision_end|>"]]
            loss += [0] * (image_tokens + 2)
            grid = side * _MERGE
            pixels.append(torch.randn(grid * grid, _PATCH_DIM, generator=gen))
        ids += torch.randint(low, vocab_size, (sampled_tokens,), generator=gen).tolist()
        loss += [1] * sampled_tokens
    return _row(ids, loss, pixels, [pixel_key(p) for p in pixels], side * _MERGE, gen)


def vision_geometry(model_dir: str | os.PathLike) -> tuple[int, int]:
    """(values per patch, spatial merge size) of a local Qwen-VL model's vision tower."""
    import json
    from pathlib import Path

    vision = json.loads((Path(model_dir) / "config.json").read_text())["vision_config"]
    dim = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    return dim, vision["spatial_merge_size"]


def window_rows(
    turns: int,
    *,
    window: int | None,
    vocab_size: int,
    patch_dim: int = _PATCH_DIM,
    merge: int = _MERGE,
    image_tokens: int = 16,
    prompt_tokens: int = 8,
    step_tokens: int = 6,
    sampled_tokens: int = 6,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """An episode's training rows as an agent with a window of screenshots sends its calls.

    Step s has a screenshot (seeded pixels) and a line of history text. ``window=None``: the
    append-only conversation, one row of every step and its sampled tokens. ``window=k``: one
    row per call (each call breaks the prefix), call t holding the system prompt, the history
    text of the steps before its window, then the window's steps with their screenshots (MAI-UI:
    k = 3; ``k=1``: the current screenshot only), then its sampled tokens. A screenshot is the
    same tensor, under the same content key, in every row that holds it.
    """
    side = math.isqrt(image_tokens)
    if side * side != image_tokens or side < 1:
        raise ValueError(f"image_tokens={image_tokens} must be a positive square, e.g. 16")
    gen = torch.Generator().manual_seed(seed)
    low = len(SPECIAL_TOKENS)

    def ids(n: int) -> list[int]:
        return torch.randint(low, vocab_size, (n,), generator=gen).tolist()

    system = ids(prompt_tokens)
    grid = side * merge
    steps = []
    for _ in range(turns):
        pixels = torch.randn(grid * grid, patch_dim, generator=gen)
        steps.append((ids(step_tokens), pixels, pixel_key(pixels), ids(sampled_tokens)))
    image = [TOKEN_ID["<|vision_start|>"], *[TOKEN_ID["<|image_pad|>"]] * image_tokens]
    image.append(TOKEN_ID["<|vision_end|>"])

    def row(shown: range, history_of: range, trained: range) -> dict[str, Any]:
        tokens, loss, pixels, keys = list(system), [0] * len(system), [], []

        def add(run: list[int], flag: int) -> None:
            tokens.extend(run)
            loss.extend([flag] * len(run))

        for s in history_of:
            add(steps[s][0], 0)
        for s in shown:
            text, px, key, sampled = steps[s]
            add(text + image, 0)
            pixels.append(px)
            keys.append(key)
            if s in trained:
                add(sampled, 1)
        return _row(tokens, loss, pixels, keys, grid, gen)

    if window is None:
        return [row(range(turns), range(0), range(turns))]
    return [
        row(range(max(0, t - window + 1), t + 1), range(max(0, t - window + 1)), range(t, t + 1))
        for t in range(turns)
    ]


def group_rows(turns: int, *, window: int | None, seeds=(1, 2), **kwargs: Any) -> list[dict]:
    """A GRPO group's rows: one episode of ``window_rows`` per seed, in order."""
    return [row for seed in seeds for row in window_rows(turns, window=window, seed=seed, **kwargs)]


def pixel_key(pixels: torch.Tensor) -> int:
    """A screenshot's content key (the row's ``image_keys``) from its pixel values."""
    from cua_rl.trajectory.rows import image_key_of

    return image_key_of(hashlib.sha256(pixels.numpy().tobytes()).hexdigest())


def _row(tokens, loss, pixels, keys, grid: int, gen) -> dict[str, Any]:
    """A row of ``tokens`` (one sequence) with the images ``pixels`` (each ``grid`` x ``grid``
    patches) under ``keys``; behaviour logprobs and reward drawn from ``gen``."""
    input_ids = torch.tensor([tokens], dtype=torch.long)
    loss_mask = torch.tensor([loss], dtype=torch.int32)
    behaviour = -torch.rand(1, len(tokens), generator=gen) * 3.0 * loss_mask
    n = len(pixels)
    media = (
        {
            "pixel_values": torch.cat(pixels),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * n),
            "image_keys": torch.tensor(keys, dtype=torch.long),
        }
        if pixels
        else {}
    )
    return dict(
        input_ids=input_ids,
        loss_mask=loss_mask,
        attention_mask=torch.ones_like(input_ids, dtype=torch.bool),
        logprobs=behaviour.float(),
        versions=torch.where(loss_mask.bool(), 0, -1).to(torch.int32),
        rewards=torch.rand(1, generator=gen),
        mm_token_type_ids=(input_ids == TOKEN_ID["<|image_pad|>"]).long(),
        multi_modal_input=[media],
    )
