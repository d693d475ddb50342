"""The monitor's side of the trajectory warehouse: stored episodes in, and out again.

``apply_episodes`` writes a batch's ``episodes`` records in the batch's transaction, after every
other kind (a record names its rollout by client id, the rollout uuid): each is checked
(``cua_rl.warehouse.check_record``: fields, blob lengths) and refused as the record at its index
otherwise, so the client drops that one and counts it. A record sent again (a spool replay) is a
no-op. ``put_images`` stores ``episode_images`` in the screenshot store before the batch is
applied. The reads (``successes``, ``training_episodes``, the export's ``export_episodes``) return
records in the form the API answers and ``cua_rl.warehouse.episode_from_json`` reads; replay's
query leaves out an episode whose images the screenshot store lacks and counts it (``skipped``).
"""

from __future__ import annotations

import base64
import binascii
import json
import sqlite3
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from cua_rl.monitor.protocol import EPISODE_KIND, HEX_DIGEST, IMAGE_KIND, ScreenshotError
from cua_rl.monitor.server.batch import IngestValidationError
from cua_rl.monitor.server.schema import EPISODE_STORE_VERSION
from cua_rl.warehouse.episode import StoredEpisodeError, check_record

# The training a rollout belongs to, through its step, eval or baseline.
_TRAINING_OF_ROLLOUT = """
SELECT COALESCE(s.training_id, e.training_id, b.training_id)
FROM rollout r
LEFT JOIN step s ON s.id = r.step_id
LEFT JOIN eval e ON e.id = r.eval_id
LEFT JOIN baseline b ON b.id = r.baseline_id
WHERE r.id = ?
"""


class NoEpisodeStore(LookupError):
    """The database predates the warehouse's migration."""


def has_store(conn: sqlite3.Connection) -> bool:
    return (
        conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'episode_store'"
        ).fetchone()
        is not None
    )


def require_store(conn: sqlite3.Connection) -> None:
    if not has_store(conn):
        try:
            version = conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0]
        except sqlite3.Error:
            version = 0
        raise NoEpisodeStore(
            f"the database has no episode store: it is at schema version {version}, and the "
            f"store is migration {EPISODE_STORE_VERSION} ('trajectory warehouse'); open it once "
            "with this version's monitor (python -m cua_rl.monitor serve --db ...) to migrate it, "
            "then record episodes with monitor.store_episodes"
        )


def put_images(records: Any, put) -> int:
    """Store each ``episode_images`` record with ``put(sha256, bytes)``; returns how many."""
    if not isinstance(records, list):
        raise IngestValidationError("must be an array of objects", kind=IMAGE_KIND)
    for index, record in enumerate(records):
        try:
            digest, data = record["sha256"], record["data"]
            if not isinstance(digest, str) or not HEX_DIGEST.match(digest):
                raise IngestValidationError(
                    "must be 64 lowercase hex digits", kind=IMAGE_KIND, index=index, field="sha256"
                )
            raw = base64.b64decode(data, validate=True)
        except IngestValidationError:
            raise
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise IngestValidationError(
                f"needs sha256 and base64 data ({type(exc).__name__})", kind=IMAGE_KIND, index=index
            ) from None
        try:
            put(digest, raw)
        except ScreenshotError as exc:
            raise IngestValidationError(
                f"{exc.code}: {exc}", kind=IMAGE_KIND, index=index, field="data"
            ) from None
    return len(records)


def apply_episodes(ctx, records: Any) -> list[dict[str, Any]]:
    """Insert a batch's ``episodes`` records (``ctx``: the batch's ``BatchContext``)."""
    from cua_rl.monitor.server.batch import BadField

    if not isinstance(records, list):
        raise IngestValidationError("must be an array of objects", kind=EPISODE_KIND)
    conn, out = ctx.conn, []
    for index, record in enumerate(records):
        try:
            blob, rows = check_record(record)
        except StoredEpisodeError as exc:
            raise IngestValidationError(
                exc.args[0], kind=EPISODE_KIND, index=index, field=exc.field
            ) from None
        cid = record["client_id"]
        found = conn.execute("SELECT id FROM episode_store WHERE client_id = ?", (cid,)).fetchone()
        if found is not None:  # sent again (a replay): already stored
            out.append({"client_id": cid, "id": found[0]})
            continue
        try:
            rollout = ctx.resolve("rollout", record["rollout_client_id"], "rollout_client_id")
        except BadField as exc:
            raise IngestValidationError(
                exc.message, kind=EPISODE_KIND, index=index, field=exc.field
            ) from None
        training = conn.execute(_TRAINING_OF_ROLLOUT, (rollout,)).fetchone()[0]
        rows_json = json.dumps(rows, separators=(",", ":"))
        turns_json = json.dumps(record.get("turns") or [], separators=(",", ":"))
        try:
            row_id = conn.execute(
                "INSERT INTO episode_store (client_id, rollout_id, training_id, task_id, "
                "episode_id, reward, success, version_min, version_max, format, n_rows, tokens, "
                "rows_json, turns_json, data, bytes) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    cid,
                    rollout,
                    training,
                    record["task_id"],
                    record["episode_id"],
                    float(record["reward"]),
                    int(record["success"]),
                    record["version_min"],
                    record["version_max"],
                    record["format"],
                    len(rows),
                    sum(r["tokens"] for r in rows),
                    rows_json,
                    turns_json,
                    blob,
                    len(blob) + len(rows_json) + len(turns_json),
                ),
            ).lastrowid
        except sqlite3.IntegrityError as exc:
            raise IngestValidationError(
                f"not stored: {exc} (one stored episode per rollout)",
                kind=EPISODE_KIND,
                index=index,
                field="rollout_client_id",
            ) from None
        images = {h for r in rows for h in r["images"]}
        conn.executemany(
            "INSERT INTO episode_image (episode_store_id, sha256) VALUES (?, ?)",
            [(row_id, h) for h in sorted(images)],
        )
        out.append({"client_id": cid, "id": row_id})
    return out


# ---------------------------------------------------------------------------- reads

_SELECT = """
SELECT es.*, t.run_name AS training, r.rollout_id AS rollout_uuid,
    (SELECT COUNT(*) FROM episode_image ei LEFT JOIN screenshot s ON s.sha256 = ei.sha256
     WHERE ei.episode_store_id = es.id AND s.sha256 IS NULL) AS missing_images
FROM episode_store es
JOIN rollout r ON r.id = es.rollout_id
LEFT JOIN training t ON t.id = es.training_id
"""


def to_json(row: sqlite3.Row, image_url=None) -> dict[str, Any]:
    """A stored row as the API answers it: ``to_record``'s form plus ``training``, ``id`` and,
    given ``image_url(hex)``, each image's URL (``image_urls``)."""
    rows = json.loads(row["rows_json"])
    out = {
        "id": row["id"],
        "client_id": row["client_id"],
        "rollout_client_id": row["rollout_uuid"],
        "training": row["training"],
        "format": row["format"],
        "task_id": row["task_id"],
        "episode_id": row["episode_id"],
        "reward": row["reward"],
        "success": bool(row["success"]),
        "version_min": row["version_min"],
        "version_max": row["version_max"],
        "rows": rows,
        "turns": json.loads(row["turns_json"]),
        "data": base64.b64encode(row["data"]).decode("ascii"),
        "bytes": row["bytes"],
    }
    if image_url is not None:
        hashes = dict.fromkeys(h for r in rows for h in r["images"])
        out["image_urls"] = {h: image_url(h) for h in hashes}
    return out


def successes(
    conn: sqlite3.Connection,
    task_id: str,
    trainings: Sequence[str],
    min_version: int,
    limit: int,
    max_version: int | None = None,
) -> tuple[list[sqlite3.Row], Counter]:
    """The newest stored successes of ``task_id`` whose oldest token has version >=
    ``min_version`` (and, given ``max_version``, whose newest has version <= it), from
    ``trainings`` (run names; empty: any), whole (images all stored)."""
    require_store(conn)
    where = ["es.task_id = ?", "es.success = 1", "es.version_min >= ?"]
    params: list[Any] = [task_id, int(min_version)]
    if max_version is not None:
        where.append("es.version_max <= ?")
        params.append(int(max_version))
    if trainings:
        where.append(f"t.run_name IN ({', '.join('?' * len(trainings))})")
        params += list(trainings)
    sql = f"{_SELECT} WHERE {' AND '.join(where)} ORDER BY es.version_max DESC, es.id DESC"
    found, skipped = [], Counter()
    for row in conn.execute(sql, params):
        if row["missing_images"]:
            skipped["image_missing"] += 1
            continue
        found.append(row)
        if len(found) >= limit:
            break
    return found, skipped


def training_episodes(
    conn: sqlite3.Connection,
    training: str,
    *,
    success_only: bool = False,
    min_reward: float | None = None,
) -> Iterator[sqlite3.Row]:
    """Every stored episode of the training ``training`` (run name), oldest first."""
    require_store(conn)
    where, params = ["t.run_name = ?"], [training]
    if success_only:
        where.append("es.success = 1")
    if min_reward is not None:
        where.append("es.reward >= ?")
        params.append(float(min_reward))
    yield from conn.execute(f"{_SELECT} WHERE {' AND '.join(where)} ORDER BY es.id", params)


# The export's reads: stored episodes with the training step their rollout was sampled for.
_EXPORT_FROM = """
FROM episode_store es
JOIN rollout r ON r.id = es.rollout_id
LEFT JOIN step s ON s.id = r.step_id
LEFT JOIN training t ON t.id = es.training_id
"""


def export_filter(
    training_ids: Sequence[int],
    *,
    success_only: bool = False,
    min_reward: float | None = None,
    min_step: int | None = None,
    max_step: int | None = None,
) -> tuple[str, list[Any]]:
    """The WHERE clause (and its parameters) of the export's filters."""
    where = [f"es.training_id IN ({', '.join('?' * len(training_ids))})"]
    params: list[Any] = list(training_ids)
    if success_only:
        where.append("es.success = 1")
    for clause, value in (
        ("es.reward >= ?", min_reward),
        ("s.step >= ?", min_step),
        ("s.step <= ?", max_step),
    ):
        if value is not None:
            where.append(clause)
            params.append(value)
    return " AND ".join(where), params


def count_episodes(conn: sqlite3.Connection, where: str, params: Sequence[Any]) -> int:
    return conn.execute(f"SELECT COUNT(*) {_EXPORT_FROM} WHERE {where}", list(params)).fetchone()[0]


def export_episodes(
    conn: sqlite3.Connection, where: str, params: Sequence[Any]
) -> Iterator[sqlite3.Row]:
    """The stored episodes ``export_filter`` selects, oldest first, with ``training_step``."""
    sql = (
        "SELECT es.*, t.run_name AS training, r.rollout_id AS rollout_uuid, "
        f"s.step AS training_step {_EXPORT_FROM} WHERE {where} ORDER BY es.id"
    )
    yield from conn.execute(sql, list(params))
