"""Screenshots kept by the monitor: a content-addressed store beside the database.

:class:`ScreenshotStore` writes each image once to ``<root>/<hex[:2]>/<hex>`` (write to a
temporary file, then rename), after checking that the body is an image (PNG, JPEG or WebP by its
magic bytes, then decoded), within the size limit, and that its hash is the name it was sent
under. A ``screenshot`` table (migration 2) records size, type and time, so retention
(``max_total_bytes``) can drop the oldest images when the store grows past its bound, except the
images a stored episode of the trajectory warehouse needs (``episode_image``, migration 5). The
training side (preparing and uploading images) is ``cua_rl.monitor.worker.uploader``.
"""

from __future__ import annotations

import hashlib
import io
import os
import sqlite3
import threading
from pathlib import Path

from cua_rl.monitor.protocol import HEX_DIGEST as _HEX
from cua_rl.monitor.protocol import ScreenshotError, sniff_mime
from cua_rl.monitor.server.migrations import connect

DEFAULT_MAX_IMAGE_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_TOTAL_BYTES = 2 * 1024**3


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
            # Images a stored episode needs (the warehouse's) are kept: its rows rebuild from them.
            rows = self._conn.execute(
                "SELECT sha256, bytes FROM screenshot WHERE sha256 NOT IN "
                "(SELECT sha256 FROM episode_image) ORDER BY created_at, rowid LIMIT 64"
            ).fetchall()
            if not rows:
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
