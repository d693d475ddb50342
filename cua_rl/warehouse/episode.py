"""A stored episode: what rebuilds its training rows exactly, in a compact wire form.

An episode's rows are kept as their token data only: per row the ids, loss mask, behaviour
logprobs and per-token versions (``zlib`` over little-endian int32 / int8 / float32 / int32
arrays: one blob per episode), and the sha256 of each image its prompt holds, in order. The
images themselves are the bytes the model received, kept once in the monitor's content-addressed
screenshot store under that hash; the processor turns them into the same ``pixel_values`` again
(``rebuild.py``), so no pixel tensor is stored. ``attention_mask``, ``mm_token_type_ids``,
``image_grid_thw`` and ``image_keys`` follow from the ids and the images.

Each row also keeps the request messages of its last turn (images as ``{"type": "image"}``
placeholders, in prompt order) and the episode its turns' replies and actions, for the export.

Stdlib only: the monitor server decodes and checks a record without torch.
"""

from __future__ import annotations

import array
import base64
import re
import sys
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cua_rl.errors import CuaRlError

FORMAT = 1
# Bytes per token in the blob: id int32, mask int8, logprob float32, version int32.
BYTES_PER_TOKEN = 13
_HEX = re.compile(r"^[0-9a-f]{64}$")
_INT32 = 2**31
# Which episodes a rollout worker stores (``monitor.store_episodes``).
STORE_POLICIES = ("successes", "all", "none")


class StoredEpisodeError(CuaRlError, ValueError):
    """A stored episode record is malformed; the message names the field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class StoredRow:
    """One training row's token data, its images (sha256 hex, prompt order), the indices of the
    turns it trains, and its last request's messages (None when the agent logged none)."""

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    images: tuple[str, ...] = ()
    turns: tuple[int, ...] = ()
    messages: list[dict] | None = None
    # Each trained turn's sampled tokens, (start, end, turn index); empty in records stored
    # before they were kept (step credit then reads them from the loss mask's runs).
    spans: tuple[tuple[int, int, int], ...] = ()

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class StoredEpisode:
    """An accepted episode as stored: enough to rebuild the rows it trained, exactly.

    ``images`` maps the rows' image hashes to the bytes the model received; a record read from
    the monitor's database or API lacks them until they are fetched (``rebuild_rows`` needs
    them). ``turns``: per trained turn ``{"index", "step", "text", "actions"}``.
    """

    task_id: str
    episode_id: int
    rollout_uuid: str
    training: str
    reward: float
    success: bool
    version_min: int
    version_max: int
    rows: list[StoredRow]
    turns: list[dict] = field(default_factory=list)
    images: dict[str, bytes] = field(default_factory=dict)

    @property
    def image_hashes(self) -> list[str]:
        """Every distinct image hash of the rows, in first-use order."""
        return list(dict.fromkeys(h for r in self.rows for h in r.images))

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.rows)


def _le(arr: array.array) -> bytes:
    if sys.byteorder == "big":  # pragma: no cover - every supported platform is little-endian
        arr = array.array(arr.typecode, arr)
        arr.byteswap()
    return arr.tobytes()


def _from_le(typecode: str, raw: bytes) -> list:
    arr = array.array(typecode)
    arr.frombytes(raw)
    if sys.byteorder == "big":  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


def encode_tokens(rows: Sequence[StoredRow]) -> bytes:
    """The rows' token arrays as one compressed blob."""
    parts = []
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        if not (len(r.loss_mask) == len(r.logprobs) == len(r.versions) == n):
            raise StoredEpisodeError(f"rows[{i}]", "per-token arrays of different lengths")
        if any(not 0 <= t < _INT32 for t in r.input_ids):
            raise StoredEpisodeError(f"rows[{i}].input_ids", "an id outside [0, 2**31)")
        if any(m not in (0, 1) for m in r.loss_mask):
            raise StoredEpisodeError(f"rows[{i}].loss_mask", "values other than 0 and 1")
        parts += [
            _le(array.array("i", r.input_ids)),
            _le(array.array("b", r.loss_mask)),
            _le(array.array("f", r.logprobs)),
            _le(array.array("i", r.versions)),
        ]
    return zlib.compress(b"".join(parts), 6)


def decode_tokens(blob: bytes, lengths: Sequence[int]) -> list[tuple[list, list, list, list]]:
    """The blob's (ids, mask, logprobs, versions) per row of ``lengths`` tokens."""
    try:
        raw = zlib.decompress(blob)
    except zlib.error as exc:
        raise StoredEpisodeError("data", f"not a zlib blob: {exc}") from None
    if len(raw) != BYTES_PER_TOKEN * sum(lengths):
        raise StoredEpisodeError(
            "data", f"{len(raw)} bytes for {sum(lengths)} tokens (expected {BYTES_PER_TOKEN}/token)"
        )
    out, at = [], 0
    for n in lengths:
        ids = _from_le("i", raw[at : at + 4 * n])
        at += 4 * n
        mask = _from_le("b", raw[at : at + n])
        at += n
        lps = _from_le("f", raw[at : at + 4 * n])
        at += 4 * n
        vers = _from_le("i", raw[at : at + 4 * n])
        at += 4 * n
        out.append((ids, mask, lps, vers))
    return out


def to_record(ep: StoredEpisode) -> dict[str, Any]:
    """The ``episodes`` ingest record of ``ep`` (JSON-able; the blob in base64)."""
    return {
        "client_id": f"{ep.rollout_uuid}:episode",
        "rollout_client_id": ep.rollout_uuid,
        "format": FORMAT,
        "task_id": ep.task_id,
        "episode_id": int(ep.episode_id),
        "reward": float(ep.reward),
        "success": bool(ep.success),
        "version_min": int(ep.version_min),
        "version_max": int(ep.version_max),
        "rows": [
            {
                "tokens": len(r),
                "images": list(r.images),
                "turns": list(r.turns),
                "messages": r.messages,
                "spans": [list(span) for span in r.spans],
            }
            for r in ep.rows
        ],
        "turns": ep.turns,
        "data": base64.b64encode(encode_tokens(ep.rows)).decode("ascii"),
    }


def _want(record: Mapping, name: str, kind: type | tuple[type, ...]) -> Any:
    value = record.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise StoredEpisodeError(name, f"expected {getattr(kind, '__name__', kind)}")
    return value


def check_record(record: Any) -> tuple[bytes, list[dict]]:
    """Validate an ``episodes`` record's shape; returns (the blob, its rows' metadata)."""
    if not isinstance(record, Mapping):
        raise StoredEpisodeError("record", "must be an object")
    if record.get("format") != FORMAT:
        raise StoredEpisodeError("format", f"{record.get('format')!r} is not {FORMAT}")
    for name in ("client_id", "rollout_client_id", "task_id"):
        if not _want(record, name, str):
            raise StoredEpisodeError(name, "must not be empty")
    _want(record, "episode_id", int)
    _want(record, "reward", (int, float))
    _want(record, "success", bool)
    if _want(record, "version_min", int) > _want(record, "version_max", int):
        raise StoredEpisodeError("version_min", "is above version_max")
    rows = _want(record, "rows", list)
    if not rows:
        raise StoredEpisodeError("rows", "an episode has at least one row")
    for i, r in enumerate(rows):
        if not isinstance(r, Mapping) or not isinstance(r.get("tokens"), int) or r["tokens"] < 1:
            raise StoredEpisodeError(f"rows[{i}].tokens", "must be a positive integer")
        images = r.get("images")
        if not isinstance(images, list) or not all(
            isinstance(h, str) and _HEX.match(h) for h in images
        ):
            raise StoredEpisodeError(f"rows[{i}].images", "must be a list of sha256 hex digests")
    if not isinstance(record.get("turns", []), list):
        raise StoredEpisodeError("turns", "must be a list")
    try:
        blob = base64.b64decode(_want(record, "data", str), validate=True)
    except ValueError as exc:
        raise StoredEpisodeError("data", f"not base64: {exc}") from None
    decode_tokens(blob, [r["tokens"] for r in rows])  # lengths agree
    return blob, rows


def from_parts(
    *,
    blob: bytes,
    rows: Sequence[Mapping],
    turns: Sequence[dict],
    task_id: str,
    episode_id: int,
    rollout_uuid: str,
    training: str,
    reward: float,
    success: bool,
    version_min: int,
    version_max: int,
    images: dict[str, bytes] | None = None,
) -> StoredEpisode:
    """A ``StoredEpisode`` from the stored columns (the database's or the API's)."""
    arrays = decode_tokens(blob, [int(r["tokens"]) for r in rows])
    return StoredEpisode(
        task_id=task_id,
        episode_id=int(episode_id),
        rollout_uuid=rollout_uuid,
        training=training,
        reward=float(reward),
        success=bool(success),
        version_min=int(version_min),
        version_max=int(version_max),
        rows=[
            StoredRow(
                ids,
                mask,
                lps,
                vers,
                tuple(meta.get("images") or ()),
                tuple(meta.get("turns") or ()),
                meta.get("messages"),
                _spans(meta.get("spans")),
            )
            for (ids, mask, lps, vers), meta in zip(arrays, rows, strict=True)
        ],
        turns=list(turns),
        images=dict(images or {}),
    )


def _spans(value: Any) -> tuple[tuple[int, int, int], ...]:
    """A row's stored spans; anything but a list of three whole numbers each reads as none."""
    if not isinstance(value, list):
        return ()
    out = []
    for span in value:
        if not (isinstance(span, list) and len(span) == 3 and all(type(v) is int for v in span)):
            return ()
        out.append((span[0], span[1], span[2]))
    return tuple(out)


def episode_from_json(record: Mapping[str, Any]) -> StoredEpisode:
    """A ``StoredEpisode`` from its record (``to_record``'s form, as the monitor's API answers
    it, with ``training``); its images are not in it."""
    blob, rows = check_record(record)
    return from_parts(
        blob=blob,
        rows=rows,
        turns=record.get("turns") or [],
        task_id=record["task_id"],
        episode_id=record["episode_id"],
        rollout_uuid=record["rollout_client_id"],
        training=str(record.get("training") or ""),
        reward=record["reward"],
        success=record["success"],
        version_min=record["version_min"],
        version_max=record["version_max"],
    )
