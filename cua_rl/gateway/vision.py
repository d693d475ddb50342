"""An image's pad count from its size alone, by the processor's resize rule.

The gateway needs each new image's pad count (the prompt's length against ``gconfig.max_tokens``,
and the expanded pads for servers that do not expand them). Running the image processor for it
costs about 200 ms of CPU per phone screenshot (decode, resize, normalise, patchify) and throws
the pixels away; the count follows from the resize rule of the Qwen2-VL image processor (used by
Qwen2-VL, Qwen2.5-VL and Qwen3-VL): the image is resized to the nearest multiple of
``patch * merge`` per side within the ``[min_pixels, max_pixels]`` budget, one image is one
temporal patch, and each ``merge x merge`` block of patches is one pad. The size is read from the
image's header, not its pixels. A processor whose rule this module does not know is run as
before (one log line says why). The row builder still runs the processor and checks the pad
counts against the prompt ids, so a rule that drifted from the processor would be a counted
rejection, never a silently wrong row.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

from cua_rl.core.images import image_processor_of, iter_images, process_images
from cua_rl.logs import get_logger
from cua_rl.trajectory.config import TrajectoryConfig

log = get_logger(__name__)

# Image processors whose resize rule is ``resized_size`` (transformers' slow and fast ones).
KNOWN_PROCESSORS = frozenset({"Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast"})
MAX_ASPECT = 200  # the processor refuses more elongated images


class ImageSizeError(ValueError):
    """The image cannot be measured or the processor would refuse it."""


@dataclass(frozen=True)
class ResizeRule:
    """What the count depends on: the patch side, the merge side and the pixel budget."""

    patch: int
    merge: int
    min_pixels: int
    max_pixels: int

    @property
    def factor(self) -> int:
        return self.patch * self.merge


def resize_rule(processor) -> tuple[ResizeRule | None, str]:
    """The processor's rule, or None and why it is not known (then the processor is run)."""
    improc = image_processor_of(processor)
    name = type(improc).__name__
    if name not in KNOWN_PROCESSORS:
        return None, f"image processor {name} has no known resize rule"
    if not getattr(improc, "do_resize", True):
        return None, f"{name} has do_resize off"
    size = getattr(improc, "size", None) or {}
    low = size.get("shortest_edge", getattr(improc, "min_pixels", None))
    high = size.get("longest_edge", getattr(improc, "max_pixels", None))
    values = (getattr(improc, "patch_size", None), getattr(improc, "merge_size", None), low, high)
    if not all(isinstance(v, int) and v > 0 for v in values):
        return None, f"{name} lacks patch_size, merge_size or its pixel budget: {values}"
    return ResizeRule(*values), ""


def resized_size(rule: ResizeRule, width: int, height: int) -> tuple[int, int]:
    """(height, width) after the processor's resize: each side a multiple of ``factor``, the
    area within the budget, the aspect ratio kept as closely as that allows."""
    if min(width, height) <= 0:
        raise ImageSizeError(f"an image of {width}x{height} pixels")
    if max(width, height) / min(width, height) > MAX_ASPECT:
        raise ImageSizeError(
            f"an image of {width}x{height}: the processor refuses an aspect ratio over {MAX_ASPECT}"
        )
    f = rule.factor
    # Python's round (half to even), as the processor uses.
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > rule.max_pixels:
        scale = math.sqrt(height * width / rule.max_pixels)
        h = max(f, math.floor(height / scale / f) * f)
        w = max(f, math.floor(width / scale / f) * f)
    elif h * w < rule.min_pixels:
        scale = math.sqrt(rule.min_pixels / (height * width))
        h = math.ceil(height * scale / f) * f
        w = math.ceil(width * scale / f) * f
    return h, w


def image_grid(rule: ResizeRule, width: int, height: int) -> tuple[int, int, int]:
    """``image_grid_thw`` of one image: one temporal patch, the resized size in patches."""
    h, w = resized_size(rule, width, height)
    return 1, h // rule.patch, w // rule.patch


def pad_count(rule: ResizeRule, width: int, height: int) -> int:
    """The image's pad tokens: one per ``merge x merge`` block of patches."""
    _, gh, gw = image_grid(rule, width, height)
    return gh * gw // (rule.merge * rule.merge)


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the image's header; the pixels are not decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageSizeError(f"the image cannot be read: {exc}") from exc


class PadCounter:
    """Pad counts of new images for one processor: by the rule when known, else the processor.

    ``explained``: the reasons already logged for running the processor, shared by a gateway's
    sessions so that each is logged once per gateway, not once per episode."""

    def __init__(self, processor, images: TrajectoryConfig, explained: set[str] | None = None):
        self.processor, self.images = processor, images
        self.rule, why = resize_rule(processor)
        explained = set() if explained is None else explained
        if self.rule is None and why not in explained:
            explained.add(why)
            log.info("gateway pad counts run the image processor: %s", why)

    def counts(self, data: Sequence[bytes]) -> list[int]:
        if self.rule is not None:
            return [pad_count(self.rule, *image_size(raw)) for raw in data]
        keys = [str(i) for i in range(len(data))]
        pil = iter_images(keys, dict(zip(keys, data, strict=True)), self.images)
        return list(process_images(self.processor, pil)[2])
