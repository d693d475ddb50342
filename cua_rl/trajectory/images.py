"""Screenshots -> pixel values through the model's own processor, with a fetch policy.

Split in two so conversion stays network-free: :func:`fetch_images` is the only I/O (async,
http(s) from configured hosts only, every URL checked before the first request, size and time
bounded); :func:`load_images` and :func:`process_images` are pure and take its result. data: URLs
never need a fetch. Pixel values come from the processor saved with the model (the Qwen2-VL image
processor), the same family vLLM uses, and the number of image tokens each image needs is derived
from its grid so the row builder can check it against the prompt ids vLLM returned.
"""

from __future__ import annotations

import asyncio
import io
import itertools
from collections.abc import Iterable, Mapping, Sequence

import httpx

from cua_rl.core import images as core_images
from cua_rl.core.images import check_image_url
from cua_rl.core.reasons import Reason
from cua_rl.errors import RejectedEpisode
from cua_rl.trajectory.config import TrajectoryConfig


def decode_data_url(url: str, config: TrajectoryConfig) -> bytes:
    """A data URL's bytes, within the config's ``max_image_bytes``."""
    return core_images.decode_data_url(url, config.max_image_bytes)


async def fetch_one(client: httpx.AsyncClient, url: str, config: TrajectoryConfig) -> bytes:
    try:
        async with asyncio.timeout(config.image_fetch_timeout_s):
            async with client.stream("GET", url, follow_redirects=False) as resp:
                if resp.status_code != 200:
                    raise RejectedEpisode(
                        Reason.IMAGE_FETCH_FAILED, f"GET {url} answered {resp.status_code}"
                    )
                declared = resp.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > config.max_image_bytes:
                    raise RejectedEpisode(
                        Reason.IMAGE_TOO_LARGE,
                        f"{url} declares {declared} bytes > {config.max_image_bytes}",
                    )
                buf = bytearray()
                async for chunk in resp.aiter_bytes():
                    buf += chunk
                    if len(buf) > config.max_image_bytes:
                        raise RejectedEpisode(
                            Reason.IMAGE_TOO_LARGE, f"{url} exceeds {config.max_image_bytes} bytes"
                        )
                return bytes(buf)
    except TimeoutError as exc:
        raise RejectedEpisode(
            Reason.IMAGE_FETCH_TIMEOUT, f"{url} took over {config.image_fetch_timeout_s}s"
        ) from exc
    except httpx.HTTPError as exc:
        raise RejectedEpisode(Reason.IMAGE_FETCH_FAILED, f"GET {url}: {exc!r}") from exc


async def fetch_images(
    urls: Iterable[str],
    config: TrajectoryConfig,
    *,
    client: httpx.AsyncClient | None = None,
    concurrency: int = 8,
) -> dict[str, bytes]:
    """Fetch the http(s) images among ``urls``; data: URLs are skipped (decoded later, offline).

    Every URL is checked first, so a refused host rejects the episode before any request.
    """
    wanted: list[str] = []
    for url in urls:
        if check_image_url(url, config) == "http" and url not in wanted:
            wanted.append(url)
    if not wanted:
        return {}
    own = client is None
    client = client or httpx.AsyncClient()
    sem = asyncio.Semaphore(concurrency)

    async def one(url: str) -> tuple[str, bytes]:
        async with sem:
            return url, await fetch_one(client, url, config)

    try:
        return dict(await asyncio.gather(*(one(u) for u in wanted)))
    finally:
        if own:
            await client.aclose()


def load_images(
    urls: Sequence[str], fetched: Mapping[str, bytes], config: TrajectoryConfig
) -> list:
    """Decode the images of ``urls`` (in order) into RGB PIL images. Pure: no network."""
    return list(iter_images(urls, fetched, config))


def iter_images(urls: Iterable[str], fetched: Mapping[str, bytes], config: TrajectoryConfig):
    """Like :func:`load_images`, one image at a time (bounded memory on long episodes)."""
    for url in urls:
        yield decode_image(url, image_bytes(url, fetched, config))


def image_bytes(url: str, fetched: Mapping[str, bytes], config: TrajectoryConfig) -> bytes:
    """The encoded bytes of ``url``: fetched (or captured), or a data URL's payload."""
    # Bytes already in hand (fetched, or captured by the gateway as the model received them)
    # were vetted when they were obtained.
    if url in fetched:
        return fetched[url]
    if check_image_url(url, config) == "data":
        return decode_data_url(url, config)
    raise RejectedEpisode(Reason.IMAGE_NOT_FETCHED, f"{url} was not fetched")


def decode_image(url: str, raw: bytes):
    """``raw`` as an RGB PIL image; an undecodable image rejects the episode."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(raw))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise RejectedEpisode(Reason.IMAGE_DECODE_FAILED, f"{url[:60]}: {exc}") from exc
    return img.convert("RGB")


def image_processor_of(processor):
    return getattr(processor, "image_processor", processor)


def tokenizer_of(processor):
    return getattr(processor, "tokenizer", processor)


def image_token_ids(processor) -> tuple[int, int | None]:
    """(image pad id, video pad id) of the model's tokenizer."""
    tok = tokenizer_of(processor)
    image_id = getattr(processor, "image_token_id", None)
    if image_id is None:
        image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    video_id = getattr(processor, "video_token_id", None)
    if video_id is None:
        vid = tok.convert_tokens_to_ids("<|video_pad|>")
        video_id = vid if isinstance(vid, int) and vid != tok.unk_token_id else None
    if not isinstance(image_id, int) or image_id < 0:
        raise RejectedEpisode(
            Reason.PROCESSOR_UNSUPPORTED, "the tokenizer has no <|image_pad|> token"
        )
    return image_id, video_id


def process_images(processor, images: Iterable, *, chunk: int = 4) -> tuple:
    """(pixel_values [N_patches, D], image_grid_thw [n, 3] long, tokens per image).

    Images go through the processor a few at a time: its float intermediates at full
    resolution would otherwise dominate peak memory on long episodes (see the bench).
    """
    import torch

    improc = image_processor_of(processor)
    merge = int(getattr(improc, "merge_size", 2))
    images = iter(images)
    pixels, grids = [], []
    while batch := list(itertools.islice(images, chunk)):
        out = improc(images=batch, return_tensors="pt")
        pixels.append(out["pixel_values"].to(torch.float32))
        grids.append(out["image_grid_thw"].to(torch.long))
        del batch, out
    if not pixels:
        patch = int(getattr(improc, "patch_size", 14))
        tps = int(getattr(improc, "temporal_patch_size", 2))
        dim = 3 * tps * patch * patch
        return torch.zeros((0, dim), dtype=torch.float32), torch.zeros((0, 3), dtype=torch.long), []
    pixel_values = torch.cat(pixels) if len(pixels) > 1 else pixels[0]
    grid = torch.cat(grids) if len(grids) > 1 else grids[0]
    per_image = [int(g.prod().item()) // (merge * merge) for g in grid]
    return pixel_values, grid, per_image
