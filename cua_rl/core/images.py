"""Screenshots from what agents send: data URLs, type sniffing, the image URL policy, the fetch,
and the model's processor (pixel values, pad tokens).

Three places take screenshots from an agent's messages: the trajectory converter (into pixel
values), the gateway (into the prompt the model server renders, and the pad count it checks) and
the monitor (into its screenshot store). They decode, fetch, check and process them here, so one
screenshot is accepted, refused or measured the same way everywhere, and neither the gateway nor
the monitor hands work back to the row builder. A refusal is an ``ImageRefused``, a ``RejectedEpisode`` whose reason says
why (``image_url_refused``, ``image_too_large``, ``image_decode_failed``): the converter and the
gateway reject the episode with it, the monitor turns it into its own screenshot error.

The policy is any object with the fields of ``ImagePolicy`` (``TrajectoryConfig`` is one): only
http(s) URLs of allowed hosts are ever fetched, https only unless ``allow_http``, and no image
larger than ``max_image_bytes`` is decoded. ``fetch_images`` is the only I/O (async, http(s) from
allowed hosts only, every URL checked before the first request, size and time bounded); decoding
and processing are pure and take its result. Pixel values come from the processor saved with the
model (the Qwen2-VL image processor, the family vLLM uses), and the number of pad tokens each
image needs is derived from its grid.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol
from urllib.parse import urlsplit

import httpx

from cua_rl.core.reasons import Reason
from cua_rl.errors import RejectedEpisode

# The image types the model servers and the monitor's store take, by their magic bytes.
MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
)


class ImagePolicy(Protocol):
    allowed_image_hosts: tuple[str, ...]
    allow_http: bool
    max_image_bytes: int
    image_fetch_timeout_s: float


class ImageRefused(RejectedEpisode, ValueError):
    """An image was refused; ``reason`` is a ``Reason`` (its string is the counted code)."""


def sniff_mime(data: bytes, *, gif: bool = False) -> str | None:
    """``image/png``, ``image/jpeg`` or ``image/webp`` by the magic bytes; None otherwise.

    ``gif=True`` also knows ``image/gif``: the model servers take GIF (the gateway passes it on),
    the monitor's screenshot store does not."""
    for magic, mime in MAGIC:
        if data.startswith(magic):
            return mime
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if gif and data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    return None


def check_image_url(url: str, policy: ImagePolicy) -> str:
    """``"data"`` or ``"http"``; ``ImageRefused`` for anything the policy does not allow."""
    if url.startswith("data:"):
        return "data"
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ImageRefused(Reason.IMAGE_URL_REFUSED, f"unparsable image URL: {exc}") from exc
    allowed_schemes = ("https", "http") if policy.allow_http else ("https",)
    if parts.scheme not in allowed_schemes:
        raise ImageRefused(
            Reason.IMAGE_URL_REFUSED,
            f"scheme {parts.scheme!r} not allowed for images (allowed: {', '.join(allowed_schemes)})",
        )
    host = (parts.hostname or "").lower()
    if host not in {h.lower() for h in policy.allowed_image_hosts}:
        raise ImageRefused(
            Reason.IMAGE_URL_REFUSED,
            f"image host {host!r} is not in allowed_image_hosts {list(policy.allowed_image_hosts)}",
        )
    return "http"


def decode_data_url(url: str, max_bytes: int | None = None) -> bytes:
    """The bytes of a base64 ``data:image/...`` URL; a payload over ``max_bytes`` is refused
    before it is decoded."""
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:image/"):
        raise ImageRefused(Reason.IMAGE_DECODE_FAILED, f"not an image data URL: {header[:40]!r}")
    # Base64 expands 3 bytes to 4: the size is known before decoding.
    size = len(payload) * 3 // 4
    if max_bytes is not None and size > max_bytes:
        raise ImageRefused(Reason.IMAGE_TOO_LARGE, f"data URL of ~{size} bytes > {max_bytes}")
    if not header.endswith(";base64"):
        raise ImageRefused(Reason.IMAGE_DECODE_FAILED, "only base64 image data URLs are supported")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageRefused(Reason.IMAGE_DECODE_FAILED, f"bad base64 in data URL: {exc}") from exc


# ---- the fetch, and the model's processor ------------------------------------------------


async def fetch_one(client: httpx.AsyncClient, url: str, config: ImagePolicy) -> bytes:
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
    config: ImagePolicy,
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


def load_images(urls: Sequence[str], fetched: Mapping[str, bytes], config: ImagePolicy) -> list:
    """Decode the images of ``urls`` (in order) into RGB PIL images. Pure: no network."""
    return list(iter_images(urls, fetched, config))


def iter_images(urls: Iterable[str], fetched: Mapping[str, bytes], config: ImagePolicy):
    """Like :func:`load_images`, one image at a time (bounded memory on long episodes)."""
    for url in urls:
        yield decode_image(url, image_bytes(url, fetched, config))


def image_bytes(url: str, fetched: Mapping[str, bytes], config: ImagePolicy) -> bytes:
    """The encoded bytes of ``url``: fetched (or captured), or a data URL's payload."""
    # Bytes already in hand (fetched, or captured by the gateway as the model received them)
    # were vetted when they were obtained.
    if url in fetched:
        return fetched[url]
    if check_image_url(url, config) == "data":
        return decode_data_url(url, config.max_image_bytes)
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
