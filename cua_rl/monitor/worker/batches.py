"""Ingest batches as the worker side builds them: one record kind per key (``BATCH_ORDER``),
a list of records under each except ``training`` (one record). Pure functions: the wire
encoding, record counting, splitting an oversized batch in dependency order, and the reference
to a record by server id or client id.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from cua_rl.monitor.protocol import BATCH_ORDER


def utc_now() -> str:
    """UTC time in SQLite's CURRENT_TIMESTAMP layout with microseconds (sorts as text)."""
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


try:  # orjson encodes token/logprob arrays several times faster than the stdlib
    import orjson

    def dumps(obj: Any) -> bytes:
        try:
            return orjson.dumps(obj, default=str, option=orjson.OPT_NON_STR_KEYS)
        except TypeError:  # e.g. integers beyond 64 bits
            return json.dumps(obj, separators=(",", ":"), default=str).encode()

except ImportError:  # pragma: no cover - depends on the environment

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), default=str).encode()


def ref(name: str, value: int | str) -> dict[str, Any]:
    # An int is a server id; a str is the referenced record's client id.
    if isinstance(value, int) and not isinstance(value, bool):
        return {f"{name}_id": value}
    return {f"{name}_client_id": str(value)}


def count(batch: dict[str, Any]) -> int:
    return sum(1 if k == "training" else len(v) for k, v in batch.items())


def split(batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    # Dependency order is kept: the first half holds the earlier kinds, so references resolve.
    items = [
        (k, r)
        for k in BATCH_ORDER
        if k in batch
        for r in ([batch[k]] if k == "training" else batch[k])
    ]
    half = len(items) // 2
    out = ({}, {})
    for i, (k, r) in enumerate(items):
        target = out[0] if i < half else out[1]
        if k == "training":
            target["training"] = r
        else:
            target.setdefault(k, []).append(r)
    return out
