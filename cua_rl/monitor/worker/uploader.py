"""The training side of the screenshot store: prepare an image once, upload it in the background.

:func:`prepare_screenshot` turns whatever the agent saw (bytes, a data: URL, or bytes fetched from
a presigned URL) into one small image: downscaled so its long edge is at most ``max_edge`` pixels
(1024 by default), re-encoded as WebP, named by the SHA-256 of the encoded bytes. Observations
reference it as ``sha256:<hex>`` and keep the size the agent saw, so the dashboard can draw
actions given in the original pixels. The :class:`ScreenshotUploader` sends images to
``PUT /api/screenshots/<hex>`` in the background, once per hash, and never raises into training.
The server's side is ``cua_rl.monitor.server.screenshots.ScreenshotStore``; this module imports
nothing from the server.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import io
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from cua_rl.core import images as core_images
from cua_rl.core.images import ImageRefused
from cua_rl.logs import get_logger
from cua_rl.monitor.protocol import ScreenshotError, screenshot_uri, sniff_mime

log = get_logger(__name__)

DEFAULT_MAX_EDGE = 1024
DEFAULT_QUALITY = 80
# Largest source image decoded on the training side (pixels); PIL's own bomb guard is higher.
_MAX_SOURCE_PIXELS = 64_000_000


@dataclass(frozen=True)
class PreparedScreenshot:
    sha256: str
    data: bytes
    mime: str
    width: int  # stored image
    height: int
    source_width: int  # what the agent saw (action coordinates are in these pixels)
    source_height: int
    source_bytes: int

    @property
    def uri(self) -> str:
        return screenshot_uri(self.sha256)

    def observation_fields(self) -> dict[str, Any]:
        return {
            "screenshot_uri": self.uri,
            "image_width": self.width,
            "image_height": self.height,
            "source_width": self.source_width,
            "source_height": self.source_height,
            "image_bytes": len(self.data),
        }


def decode_data_url(url: str) -> bytes:
    """The core decoder (``cua_rl.core.images``), its refusals as the monitor's ``not_an_image``."""
    try:
        return core_images.decode_data_url(url)
    except ImageRefused as exc:
        raise ScreenshotError("not_an_image", exc.detail) from exc


def prepare_screenshot(
    raw: bytes, *, max_edge: int = DEFAULT_MAX_EDGE, quality: int = DEFAULT_QUALITY
) -> PreparedScreenshot:
    """Downscale (long edge <= ``max_edge``) and re-encode as WebP. CPU-bound: call in a thread."""
    from PIL import Image, UnidentifiedImageError

    if sniff_mime(raw) is None:
        raise ScreenshotError("not_an_image", "not a PNG, JPEG or WebP image")
    try:
        img = Image.open(io.BytesIO(raw))
        if img.width * img.height > _MAX_SOURCE_PIXELS:
            raise ScreenshotError("too_large", f"{img.width}x{img.height} is too many pixels")
        img.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ScreenshotError("not_an_image", f"undecodable image: {exc}") from exc
    src_w, src_h = img.size
    img = img.convert("RGB")
    scale = max_edge / max(src_w, src_h)
    if scale < 1:
        img = img.resize(
            (max(1, round(src_w * scale)), max(1, round(src_h * scale))), Image.Resampling.LANCZOS
        )
    buf = io.BytesIO()
    # method 4 is PIL's default speed/size balance; screenshots (flat UI) compress well.
    img.save(buf, format="WEBP", quality=quality, method=4)
    data = buf.getvalue()
    return PreparedScreenshot(
        sha256=hashlib.sha256(data).hexdigest(),
        data=data,
        mime="image/webp",
        width=img.width,
        height=img.height,
        source_width=src_w,
        source_height=src_h,
        source_bytes=len(raw),
    )


Fetch = Callable[[str], Awaitable[bytes]]


def http_fetcher(config: Any, client: httpx.AsyncClient) -> Fetch:
    """A fetch for :meth:`RolloutRecorder.screenshot` that follows the trajectory's image policy
    (allowed hosts, size and time bounds) of ``config`` (a ``TrajectoryConfig``)."""
    from cua_rl.core.images import fetch_images

    async def fetch(url: str) -> bytes:
        return (await fetch_images([url], config, client=client))[url]

    return fetch


async def screenshot_bytes(source: bytes | str, fetch: Fetch | None = None) -> bytes | None:
    """The image bytes of ``source``; None for an http(s) URL with no ``fetch``."""
    if isinstance(source, bytes | bytearray | memoryview):
        return bytes(source)
    if source.startswith("data:"):
        return decode_data_url(source)
    if fetch is None:
        return None
    return await fetch(source)


@dataclass
class UploadCounters:
    uploaded: int = 0  # images the server stored (or already had)
    skipped: int = 0  # hashes this process had uploaded before
    dropped: int = 0  # refused by the server, queue full, or out of retries
    bytes: int = 0
    last_error: str | None = None


class ScreenshotUploader:
    """Background ``PUT /api/screenshots/<hex>`` of prepared images, bounded in bytes."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        max_queue_bytes: int = 64 * 1024 * 1024,
        max_retries: int = 3,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
        timeout_s: float = 10.0,
        remember: int = 20_000,
    ):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.max_queue_bytes = max_queue_bytes
        self.max_retries = max_retries
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.timeout_s = timeout_s
        self.counters = UploadCounters()
        self._queue: collections.deque[PreparedScreenshot] = collections.deque()
        self._queued_bytes = 0
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._remember = remember
        self._lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._busy = False

    def start(self, http: httpx.AsyncClient) -> None:
        self._http = http
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = self._loop.create_task(self._run(), name="monitor-screenshots")

    def put(self, shot: PreparedScreenshot) -> bool:
        """Queue one image; never blocks or raises. False when it was dropped."""
        with self._lock:
            if shot.sha256 in self._seen:
                self.counters.skipped += 1
                return True
            if self._queued_bytes + len(shot.data) > self.max_queue_bytes:
                self.counters.dropped += 1
                self.counters.last_error = "screenshot queue full"
                return False
            self._seen[shot.sha256] = None
            while len(self._seen) > self._remember:
                self._seen.popitem(last=False)
            self._queue.append(shot)
            self._queued_bytes += len(shot.data)
        if self._wake is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)
        return True

    @property
    def idle(self) -> bool:
        return not self._queue and not self._busy

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=5.0)
            self._task = None

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                with self._lock:
                    shot = self._queue.popleft()
                    self._queued_bytes -= len(shot.data)
                self._busy = True
                try:
                    await self._upload(shot)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the worker survives anything
                    self.counters.dropped += 1
                    self.counters.last_error = f"{type(exc).__name__}: {exc}"
                finally:
                    self._busy = False

    async def _upload(self, shot: PreparedScreenshot) -> None:
        headers = {"Content-Type": shot.mime}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        url = f"{self.base_url}/api/screenshots/{shot.sha256}"
        delay = self.backoff_initial_s
        for attempt in range(self.max_retries + 1):
            try:
                resp = await self._http.put(
                    url, content=shot.data, headers=headers, timeout=self.timeout_s
                )
                if resp.status_code in (200, 201):
                    self.counters.uploaded += 1
                    self.counters.bytes += len(shot.data)
                    return
                self.counters.last_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                if resp.status_code < 500 and resp.status_code not in (408, 429):
                    break  # refused: retrying the same bytes cannot help
            except httpx.HTTPError as exc:
                self.counters.last_error = f"{type(exc).__name__}: {exc}"
            if attempt < self.max_retries:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_s)
        self.counters.dropped += 1
        with self._lock:
            self._seen.pop(shot.sha256, None)  # a later turn with the same image may try again
        log.warning(
            "monitor: screenshot %s not stored: %s", shot.sha256[:12], self.counters.last_error
        )
