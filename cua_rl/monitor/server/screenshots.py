"""Screenshots kept by the monitor: a content-addressed store beside the database.

Training side, :func:`prepare_screenshot` turns whatever the agent saw (bytes, a data: URL, or
bytes fetched from a presigned URL) into one small image: downscaled so its long edge is at most
``max_edge`` pixels (1024 by default), re-encoded as WebP, named by the SHA-256 of the encoded
bytes. Observations reference it as ``sha256:<hex>`` (:func:`screenshot_uri`) and keep the size
the agent saw, so the dashboard can draw actions given in the original pixels. The
:class:`ScreenshotUploader` sends images to ``PUT /api/screenshots/<hex>`` in the background,
once per hash, and never raises into training.

Server side, :class:`ScreenshotStore` writes each image once to ``<root>/<hex[:2]>/<hex>``
(write to a temporary file, then rename), after checking that the body is an image (PNG, JPEG or
WebP by its magic bytes, then decoded), within the size limit, and that its hash is the name it
was sent under. A ``screenshot`` table (migration 2) records size, type and time, so retention
(``max_total_bytes``) can drop the oldest images when the store grows past its bound.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import io
import os
import re
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from cua_rl.core.images import decode_data_url, sniff_mime
from cua_rl.errors import CuaRlError
from cua_rl.logs import get_logger
from cua_rl.monitor.server.migrations import connect

log = get_logger(__name__)

URI_PREFIX = "sha256:"
DEFAULT_MAX_EDGE = 1024
DEFAULT_QUALITY = 80
DEFAULT_MAX_IMAGE_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_TOTAL_BYTES = 2 * 1024**3
_HEX = re.compile(r"^[0-9a-f]{64}$")
# Largest source image decoded on the training side (pixels); PIL's own bomb guard is higher.
_MAX_SOURCE_PIXELS = 64_000_000


class ScreenshotError(CuaRlError, ValueError):
    """An image was refused; ``code`` is stable (``not_an_image``, ``too_large``, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def screenshot_uri(sha256: str) -> str:
    return f"{URI_PREFIX}{sha256}"


def parse_screenshot_uri(uri: Any) -> str | None:
    """The hash of a ``sha256:<hex>`` reference; None for anything else (an URL, a note)."""
    if isinstance(uri, str) and uri.startswith(URI_PREFIX):
        digest = uri[len(URI_PREFIX) :]
        if _HEX.match(digest):
            return digest
    return None


# ---------------------------------------------------------------------------- training side


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
    from cua_rl.trajectory.images import fetch_images

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


# ---------------------------------------------------------------------------- server side


def default_root(db_path: str | Path) -> Path:
    """``runs/x/monitor.db`` -> ``runs/x/monitor.screenshots`` (beside the database)."""
    p = Path(db_path)
    return p.with_name(p.stem + ".screenshots")


class ScreenshotStore:
    """Content-addressed image files under ``root`` with their rows in the monitor database."""

    def __init__(
        self,
        db_path: str | Path,
        root: str | Path | None = None,
        *,
        max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    ):
        if max_image_bytes < 1024:
            raise ValueError("max_image_bytes must be at least 1024")
        if max_total_bytes < max_image_bytes:
            raise ValueError("max_total_bytes (retention) must be at least max_image_bytes")
        self.root = Path(root) if root is not None else default_root(db_path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_image_bytes = max_image_bytes
        self.max_total_bytes = max_total_bytes
        self._conn = connect(db_path)  # the MonitorStore has migrated the file already
        self._lock = threading.Lock()
        self._total = self._conn.execute(
            "SELECT COALESCE(SUM(bytes), 0) FROM screenshot"
        ).fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def path_of(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    @property
    def total_bytes(self) -> int:
        return self._total

    def put(self, sha256: str, data: bytes, *, now: str | None = None) -> bool:
        """Store ``data`` under its hash; True if new, False if it was already there."""
        if not _HEX.match(sha256):
            raise ScreenshotError("bad_hash", "the name must be 64 lowercase hex digits (SHA-256)")
        if len(data) > self.max_image_bytes:
            raise ScreenshotError(
                "too_large", f"{len(data)} bytes exceeds the limit of {self.max_image_bytes}"
            )
        mime = sniff_mime(data)
        if mime is None:
            raise ScreenshotError("not_an_image", "the body is not a PNG, JPEG or WebP image")
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise ScreenshotError(
                "hash_mismatch", f"the body's SHA-256 is {actual}, not the {sha256} it was sent as"
            )
        width, height = _image_size(data)
        with self._lock:
            if (
                self._conn.execute(
                    "SELECT 1 FROM screenshot WHERE sha256 = ?", (sha256,)
                ).fetchone()
                and self.path_of(sha256).exists()
            ):
                return False
            path = self.path_of(sha256)
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_name(f".{sha256}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            try:
                self._conn.execute(
                    "INSERT OR REPLACE INTO screenshot (sha256, mime, bytes, width, height, "
                    "created_at) VALUES (?, ?, ?, ?, ?, COALESCE(?, "
                    "strftime('%Y-%m-%d %H:%M:%f', 'now')))",
                    (sha256, mime, len(data), width, height, now),
                )
            except sqlite3.Error:
                path.unlink(missing_ok=True)
                raise
            self._total += len(data)
            self._enforce_retention()
        return True

    def get(self, sha256: str) -> tuple[Path, str] | None:
        if not _HEX.match(sha256):
            return None
        with self._lock:  # one connection, shared by the server's worker threads
            row = self._conn.execute(
                "SELECT mime FROM screenshot WHERE sha256 = ?", (sha256,)
            ).fetchone()
        path = self.path_of(sha256)
        if row is None or not path.exists():
            return None
        return path, row[0]

    def _enforce_retention(self) -> None:
        """Drop the oldest images until the store is within ``max_total_bytes``."""
        while self._total > self.max_total_bytes:
            rows = self._conn.execute(
                "SELECT sha256, bytes FROM screenshot ORDER BY created_at, rowid LIMIT 64"
            ).fetchall()
            if not rows:
                self._total = 0
                return
            for sha256, size in rows:
                self._conn.execute("DELETE FROM screenshot WHERE sha256 = ?", (sha256,))
                self.path_of(sha256).unlink(missing_ok=True)
                self._total -= size
                if self._total <= self.max_total_bytes:
                    return

    def stats(self) -> dict[str, int]:
        with self._lock:
            n, total = self._conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM screenshot"
            ).fetchone()
        return {"images": n, "bytes": total, "max_total_bytes": self.max_total_bytes}


def _image_size(data: bytes) -> tuple[int, int]:
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.verify()  # structure check without decoding all pixels
        return img.size
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ScreenshotError(
            "not_an_image", f"the body does not decode as an image: {exc}"
        ) from exc
