"""Pad counts from the image's size against the real processors (the oracle) of every family
the repository builds, and of the released pixel budgets, on a table of image sizes."""

from __future__ import annotations

import io
import logging

import pytest
from PIL import Image as PILImage

from cua_rl.gateway import vision
from cua_rl.gateway.vision import (
    ImageSizeError,
    PadCounter,
    image_grid,
    image_size,
    pad_count,
    resize_rule,
)
from cua_rl.testing.cache import FAMILY_KINDS, ensure_model
from cua_rl.testing.models import processor_kwargs
from cua_rl.trajectory.config import TrajectoryConfig

KINDS = ("qwen2-vl-bpe", *FAMILY_KINDS)
# (width, height): tiny, odd, a phone screenshot both ways, under min_pixels, over max_pixels,
# exact multiples, sides at x.5 factors (the rounding's ties), and a long strip.
SIZES = [
    (5, 7),
    (333, 517),
    (1080, 2400),
    (2400, 1080),
    (20, 20),
    (4000, 3000),
    (28 * 7, 28 * 5),
    (32 * 5, 32 * 9),
    (70, 126),
    (80, 144),
    (10, 1900),
]


@pytest.fixture(scope="module", params=KINDS)
def family_processor(request):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(ensure_model(request.param))


def _released(patch: int, max_pixels: int, fast: bool):
    """An image processor with a released checkpoint's budget (the tiny models' are small)."""
    import transformers

    cls = transformers.Qwen2VLImageProcessorFast if fast else transformers.Qwen2VLImageProcessor
    return cls(**processor_kwargs(patch, min_pixels=patch * patch * 4 * 4, max_pixels=max_pixels))


def _oracle(improc, width: int, height: int) -> tuple[list[int], int]:
    """The processor's grid and pad count for an image of that size."""
    image = PILImage.new("RGB", (width, height), (120, 30, 200))
    grid = improc(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    return grid, grid[0] * grid[1] * grid[2] // (improc.merge_size**2)


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", (width, height), (10, 200, 90)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("width,height", SIZES)
def test_the_rule_gives_the_processor_s_grid_and_pads_for_every_family(
    family_processor, width, height
):
    rule, why = resize_rule(family_processor)
    assert rule is not None, why
    grid, pads = _oracle(family_processor.image_processor, width, height)
    assert list(image_grid(rule, width, height)) == grid
    assert pad_count(rule, width, height) == pads


def test_the_count_is_the_pads_the_processor_writes_into_the_prompt(family_processor):
    """The strongest oracle: the processor expanding one image pad in a prompt."""
    tok = family_processor.tokenizer
    pad = "<|image_pad|>"
    rule, _ = resize_rule(family_processor)
    for width, height in [(1080, 2400), (333, 517)]:
        image = PILImage.new("RGB", (width, height), (1, 2, 3))
        out = family_processor(
            text=[f"<|vision_start|>{pad}<|vision_end|>"], images=[image], return_tensors="pt"
        )
        written = int((out["input_ids"][0] == tok.convert_tokens_to_ids(pad)).sum())
        assert pad_count(rule, width, height) == written


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize(
    "patch,max_pixels",
    [(14, 12_845_056), (14, 1_003_520), (16, 16_777_216), (16, 1_048_576)],
)
@pytest.mark.parametrize("width,height", [(1080, 2400), (2400, 1080), (333, 517), (20, 20)])
def test_the_rule_holds_at_the_released_budgets(fast, patch, max_pixels, width, height):
    improc = _released(patch, max_pixels, fast)
    rule, why = resize_rule(improc)
    assert rule is not None, why
    grid, pads = _oracle(improc, width, height)
    assert list(image_grid(rule, width, height)) == grid
    assert pad_count(rule, width, height) == pads


def test_the_size_is_read_from_the_header_and_bad_images_are_refused():
    assert image_size(_png(1080, 2400)) == (1080, 2400)
    with pytest.raises(ImageSizeError, match="cannot be read"):
        image_size(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    rule, _ = resize_rule(_released(14, 1_003_520, True))
    with pytest.raises(ImageSizeError, match="aspect ratio"):
        pad_count(rule, 2, 500)


def test_a_processor_without_a_known_rule_is_run():
    improc = _released(14, 1_003_520, True)
    improc.do_resize = False
    counter = PadCounter(improc, TrajectoryConfig())
    assert counter.rule is None
    sizes = [(56, 84), (112, 28)]
    counts = counter.counts([_png(w, h) for w, h in sizes])
    assert counts == [_oracle(improc, w, h)[1] for w, h in sizes]


def test_the_fallback_is_logged_once_per_reason():
    improc = _released(16, 1_048_576, False)
    improc.do_resize = False
    # The module's own logger (it does not propagate, and AReaL may have replaced the logger
    # manager since it was made): listen on it directly.
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    vision.log.addHandler(handler)
    explained: set[str] = set()  # a gateway's, shared by its sessions
    try:
        PadCounter(improc, TrajectoryConfig(), explained)
        PadCounter(improc, TrajectoryConfig(), explained)
    finally:
        vision.log.removeHandler(handler)
    lines = [r.getMessage() for r in records if "do_resize off" in r.getMessage()]
    assert lines == [
        "gateway pad counts run the image processor: Qwen2VLImageProcessor has do_resize off"
    ]
