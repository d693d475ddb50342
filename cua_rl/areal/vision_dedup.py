"""Each distinct screenshot of a micro-batch through the vision tower once, for AReaL's FSDP actor.

An agent that keeps a window of screenshots puts each one into several training rows (MAI-UI's
3-screenshot window: up to 3 rows), and AReaL's actor runs the vision tower on every image of
every row. Rows carry each image's identity (``image_keys`` in their ``multi_modal_input``: a
content hash, written by the converter), so per micro-batch:

- ``_prepare_mb_list`` (on the CPU, before AReaL moves the micro-batches to the device) gives
  AReaL the rows without their ``pixel_values``, then puts into each micro-batch the patches of
  its distinct images only, their grid, and an index from every placeholder token of the
  micro-batch (in AReaL's image order) to its image's row in the tower's output, or no index
  when no image repeats (rows of the current screenshot only: the output is then used as it is,
  with no gather and no scatter of its gradient); ``plan_images`` is that pure step. A key seen
  twice must carry the same grid and pixels.
- ``_prepare_mb_inputs`` takes the index and grid out of the model's inputs for that
  micro-batch; hooks on the tower (``model.model.visual``) hand it the distinct grid and spread
  its output (``pooler_output``, and Qwen3-VL's ``deepstack_features``) over the placeholder
  spans by indexing, so autograd sums each image's gradients over its spans.

With ``pack_episodes`` (``cua_rl.areal.packing``) AReaL's packer fills the micro-batches in row
order, so an episode's rows, contiguous and in turn order, share micro-batches. The model still
gets one tower call per micro-batch that holds an image, on every rank, as with AReaL's path. ``freeze`` (``actor.vision.freeze``) sets the tower's parameters not to
require gradients before FSDP wraps the model. The tower hook counts what it encodes; each
batch records ``cua_vision/row_images`` (images its rows hold), ``cua_vision/distinct_images``
(distinct per micro-batch) and ``cua_vision/encoded_images`` (what the tower ran on), summed over
the step's forward passes and ranks, made on the engine's device (NCCL reduces nothing else).
Where deduplication cannot apply the batch takes AReaL's
path, and the reason is logged once. docs/vision.md has the design and the measurements.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from areal.utils import stats_tracker

from cua_rl.areal.packing import in_row_order
from cua_rl.areal.vision import vision_section
from cua_rl.errors import CuaRlError
from cua_rl.logs import get_logger

log = get_logger(__name__)

# Keys of a padded micro-batch that never reach the model (taken out by _prepare_mb_inputs).
INDEX_KEY = "cua_image_index"
GRID_KEY = "cua_image_grid"
# The row's per-image content keys, beside pixel_values and image_grid_thw.
IMAGE_KEYS = "image_keys"
_VIDEO_KEYS = ("video_grid_thw", "pixel_values_videos")


class ImageIdentityError(CuaRlError):
    """Two images under one key differ: deduplicating them would train on the wrong image."""


@dataclass
class ImagePlan:
    """One micro-batch's images: the distinct ones, and where each placeholder token reads."""

    pixel_values: torch.Tensor  # the distinct images' patches, in first-seen order
    grid: torch.Tensor  # [distinct, 3]
    # [placeholder tokens of the micro-batch] -> tower output row; None when no image repeats,
    # so the placeholders read the tower's output in order and it is used as it is.
    token_index: torch.Tensor | None
    images: int
    distinct: int


def row_images(media: Mapping[str, Any]) -> int:
    grid = media.get("image_grid_thw")
    return 0 if grid is None else int(grid.shape[0])


def plan_images(media: Sequence[Mapping[str, Any]], merge: int) -> ImagePlan | None:
    """The distinct images of rows ``media`` (their ``multi_modal_input`` dicts, in micro-batch
    order), or None when they hold none. ``merge``: the tower's spatial merge size."""
    chunks: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    seen: dict[int, int] = {}  # key -> distinct index
    offsets: list[int] = []  # distinct index -> first output row
    spans: list[torch.Tensor] = []
    tokens = 0
    images = 0
    for item in media:
        n = row_images(item)
        if n == 0:
            continue
        grid = item["image_grid_thw"]
        # One read of the row's sizes and keys (each int() of a device tensor is a host sync).
        patches, keys = grid.prod(-1).tolist(), item[IMAGE_KEYS].tolist()
        pixels = torch.split(item["pixel_values"], patches)
        for i in range(n):
            images += 1
            key = int(keys[i])
            size = patches[i] // (merge * merge)
            d = seen.get(key)
            if d is None:
                d = seen[key] = len(chunks)
                chunks.append(pixels[i])
                grids.append(grid[i])
                offsets.append(tokens)
                tokens += size
            elif not (torch.equal(grids[d], grid[i]) and torch.equal(chunks[d], pixels[i])):
                raise ImageIdentityError(
                    f"image key {key} names two different images (grids {grids[d].tolist()} and "
                    f"{grid[i].tolist()}): the rows' image_keys must be content hashes"
                )
            spans.append((offsets[d], size))
    if not chunks:
        return None
    repeats = images > len(chunks)
    return ImagePlan(
        pixel_values=torch.cat(chunks),
        grid=torch.stack(grids),
        token_index=torch.cat([torch.arange(o, o + n) for o, n in spans]) if repeats else None,
        images=images,
        distinct=len(chunks),
    )


def batch_reason(media: Sequence[Mapping[str, Any]]) -> str:
    """Why a batch's rows cannot be deduplicated, or ""."""
    for item in media:
        if any(k in item for k in _VIDEO_KEYS):
            return "the rows hold video"
        n = row_images(item)
        if n and (IMAGE_KEYS not in item or int(item[IMAGE_KEYS].numel()) != n):
            return f"rows without image identity ({IMAGE_KEYS} with one key per image)"
    return ""


def _distinct_images(media: Sequence[Mapping[str, Any]]) -> int:
    """Distinct image keys of ``media``; its image count when an image has no key."""
    keys = set()
    for item in media:
        if row_images(item):
            if IMAGE_KEYS not in item or int(item[IMAGE_KEYS].numel()) != row_images(item):
                return sum(row_images(m) for m in media)
            keys.update(int(k) for k in item[IMAGE_KEYS])
    return len(keys)


def count(name: str, n: int, device: torch.device | str) -> None:
    """Record ``cua_vision/<name>`` += ``n``: a SUM-reduced statistic (AReaL's denominators
    sum their booleans), a step's total over its forward passes and ranks.

    The tensor is made on ``device``, the engine's: ``export_stats`` all-reduces it over the
    data-parallel group, and NCCL refuses a CPU tensor ("No backend type associated with device
    type cpu") where gloo, the only backend a CPU run has, takes it.
    """
    with stats_tracker.DEFAULT_TRACKER.disable_scope():
        flags = torch.arange(max(n, 1), device=device) < n
        stats_tracker.denominator(**{f"cua_vision/{name}": flags})


@dataclass
class _Active:
    """The plan of the micro-batch being forwarded, on the device."""

    index: torch.Tensor | None  # None: the tower's output is used as it is
    grid: torch.Tensor
    applied: bool = False


def _mb_rows(mb_list) -> list[list[int]]:
    """The batch rows of each micro-batch, in packed order (AReaL's ``forward_indices``)."""
    order, groups, start = mb_list.forward_indices, [], 0
    for mb in mb_list.mbs:
        n = int(mb["cu_seqlens"].numel()) - 1
        groups.append(order[start : start + n])
        start += n
    if start != len(order):
        raise CuaRlError(f"micro-batches hold {start} rows of {len(order)}")
    return groups


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision tower of a transformers Qwen-VL model (``model.model.visual``), or None."""
    inner = model.model if isinstance(getattr(model, "model", None), torch.nn.Module) else None
    tower = inner.visual if inner is not None and hasattr(inner, "visual") else None
    return tower if isinstance(tower, torch.nn.Module) else None


class VisionDedupMixin:
    """Put before ``FSDPPPOActor``: distinct images through the tower once per micro-batch."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.vision = vision_section(config)
        self._image_plan: _Active | None = None
        self._tower_hooked = False
        self._encoded = 0
        self._logged: set[str] = set()

    # -- the model ---------------------------------------------------------------------------

    def _create_device_model(self):
        super()._create_device_model()
        if self.vision.freeze:
            tower = vision_tower(self.model)
            if tower is None:
                raise CuaRlError(
                    "actor.vision.freeze is set but the model has no vision tower "
                    "(model.model.visual): set actor.vision.freeze=false for a text model"
                )
            # Before FSDP wraps the model: no gradient, no optimizer update, no activations.
            tower.requires_grad_(False)
            log.info(
                "vision tower frozen: %d parameters", sum(p.numel() for p in tower.parameters())
            )

    def _hook_tower(self) -> None:
        if self._tower_hooked:
            return
        tower = vision_tower(self.model)
        if tower is None:
            return
        tower.register_forward_pre_hook(self._tower_inputs, with_kwargs=True)
        tower.register_forward_hook(self._tower_outputs, with_kwargs=True)
        self._tower_hooked = True

    def _tower_inputs(self, tower, args, kwargs):
        plan = self._image_plan
        grid = kwargs.get("grid_thw")
        if plan is None:
            self._encoded += 0 if grid is None else int(grid.shape[0])
            return None
        if grid is None:
            raise CuaRlError(
                "the vision tower was called without grid_thw= (transformers' get_image_features "
                "changed): set actor.vision.dedup=false and report this"
            )
        if plan.applied:
            raise CuaRlError("the vision tower ran twice in one micro-batch")
        patches = int(plan.grid.prod(-1).sum())
        if args[0].shape[0] != patches:
            raise CuaRlError(
                f"the vision tower got {args[0].shape[0]} patches, the distinct images hold "
                f"{patches}: set actor.vision.dedup=false and report this"
            )
        self._encoded += int(plan.grid.shape[0])
        return args, {**kwargs, "grid_thw": plan.grid}

    def _tower_outputs(self, tower, args, kwargs, output):
        plan = self._image_plan
        if plan is None:
            return None
        plan.applied = True
        if plan.index is None:
            return None
        # Index (not copy) so that autograd adds each span's gradient into its image's row.
        output.pooler_output = output.pooler_output[plan.index]
        deepstack = output.get("deepstack_features")
        if deepstack is not None:
            output.deepstack_features = [f[plan.index] for f in deepstack]
        return output

    # -- micro-batches -----------------------------------------------------------------------

    def _dedup_reason(self) -> str:
        if not self.vision.dedup:
            return "actor.vision.dedup is off"
        if self.parallel_helper.sp_size > 1:
            return f"sequence parallelism (sp={self.parallel_helper.sp_size}) splits the rows"
        if self.enable_tree_training:
            return "tree training packs shared prefixes"
        if self.config.use_lora:
            return "LoRA wraps the model"
        if vision_tower(self.model) is None:
            return "the model has no vision tower (model.model.visual)"
        return ""

    def _fall_back(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("vision deduplication off for these rows: %s (AReaL's path)", reason)

    def _prepare_mb_list(self, input_: dict[str, Any]):
        # AReaL reads row i's media at index i; a batch rebuilt from split rows (eval_batch on
        # compute_advantages' output) repeats the whole list after its first len(rows) entries.
        rows = int(input_["attention_mask"].shape[0])
        media = list(input_.get("multi_modal_input") or [])[:rows]
        images = sum(row_images(m) for m in media)
        if images == 0:
            return super()._prepare_mb_list(input_)
        self._hook_tower()
        reason = self._dedup_reason() or batch_reason(media)
        if reason:
            self._fall_back(reason)
            mb_list = super()._prepare_mb_list(input_)
            distinct = sum(_distinct_images([media[r] for r in g]) for g in _mb_rows(mb_list))
            count("row_images", images, self.device)
            count("distinct_images", distinct, self.device)
            return mb_list
        # AReaL concatenates each micro-batch's pixel_values: give it none, then the distinct ones.
        stripped = [{k: v for k, v in m.items() if k != "pixel_values"} for m in media]
        with in_row_order() if self.vision.pack_episodes else contextlib.nullcontext():
            mb_list = super()._prepare_mb_list({**input_, "multi_modal_input": stripped})
        merge = vision_tower(self.model).spatial_merge_size
        distinct = 0
        for group, padded in zip(_mb_rows(mb_list), mb_list.padded_mbs, strict=True):
            plan = plan_images([media[r] for r in group], merge)
            if plan is None:
                continue
            padded["pixel_values"] = plan.pixel_values
            padded[GRID_KEY] = plan.grid
            if plan.token_index is not None:
                padded[INDEX_KEY] = plan.token_index
            distinct += plan.distinct
        count("row_images", images, self.device)
        count("distinct_images", distinct, self.device)
        return mb_list

    def _prepare_mb_inputs(self, mb_item):
        padded = mb_item.padded_mb
        self._image_plan = None
        if GRID_KEY in padded:
            self._image_plan = _Active(index=padded.get(INDEX_KEY), grid=padded[GRID_KEY])
            mb_item = mb_item._replace(
                padded_mb={k: v for k, v in padded.items() if k not in (INDEX_KEY, GRID_KEY)}
            )
        return super()._prepare_mb_inputs(mb_item)

    def forward_backward_batch(self, mb_list, process_output_fn, forward_only: bool = False):
        self._encoded = 0
        try:
            return super().forward_backward_batch(mb_list, process_output_fn, forward_only)
        finally:
            self._image_plan = None
            if self._tower_hooked:
                count("encoded_images", self._encoded, self.device)
