"""Image bytes from what agents send: data URLs, type sniffing and the image URL policy.

Three places take screenshots from an agent's messages: the trajectory converter (into pixel
values), the gateway (into the prompt the model server renders) and the monitor (into its
screenshot store). They decode and check them here, so one screenshot is accepted or refused the
same way everywhere. A refusal is an ``ImageRefused``, a ``RejectedEpisode`` whose reason says
why (``image_url_refused``, ``image_too_large``, ``image_decode_failed``): the converter and the
gateway reject the episode with it, the monitor turns it into its own screenshot error.

The policy is any object with the fields of ``ImagePolicy`` (``TrajectoryConfig`` is one): only
http(s) URLs of allowed hosts are ever fetched, https only unless ``allow_http``, and no image
larger than ``max_image_bytes`` is decoded.
"""

from __future__ import annotations

import base64
import binascii
from typing import Protocol
from urllib.parse import urlsplit

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
