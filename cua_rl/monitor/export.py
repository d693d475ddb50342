"""``python -m cua_rl.monitor export``: a training's stored episodes as a Hugging Face dataset.

Reads the trajectory warehouse of a monitor database offline (``episode_store``, the images in the
screenshot store beside it) and writes one record per episode with ``datasets``' ``save_to_disk``.
A record is TRL's conversational layout with images: ``messages`` (the last row's request as the
model received it, images as ``{"type": "image"}`` placeholders, then the reply) and ``images``
(those placeholders' images in order, then any other image of the episode's rows), plus the
task, the reward, the turns (reply, actions, and the exact sampled ids, logprobs and versions of
each) and ``rows``: each training row's exact ids, loss mask, logprobs, versions and images (as
indices into ``images``), from which :func:`episode_from_record` and ``rebuild_rows`` give back
the rows that were trained. Images are kept as the bytes the model received.

An episode that cannot be exported whole is skipped and counted by reason (``image_missing``,
``no_messages``: the agent logged no request, ``image_placeholders``: its messages name another
number of images than its last row holds).
"""

from __future__ import annotations

import json
import sqlite3
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cua_rl.errors import CuaRlError
from cua_rl.monitor.server import episodes as store
from cua_rl.monitor.server.screenshots import default_root
from cua_rl.warehouse.episode import StoredEpisode, StoredRow, episode_from_json

PROGRESS_EVERY = 100


class ExportError(CuaRlError, ValueError):
    """The export cannot run: the message says why and what to change."""


@dataclass
class ExportReport:
    episodes: int = 0
    rows: int = 0
    images: int = 0
    skipped: Counter = field(default_factory=Counter)


def features():
    """The dataset's columns (``datasets.Features``)."""
    from datasets import Features, Image, List, Value

    part = {"type": Value("string"), "text": Value("string")}
    return Features(
        {
            "episode_id": Value("int64"),
            "rollout_uuid": Value("string"),
            "training": Value("string"),
            "task_id": Value("string"),
            "reward": Value("float32"),
            "success": Value("bool"),
            "version_min": Value("int32"),
            "version_max": Value("int32"),
            "messages": List({"role": Value("string"), "content": List(part)}),
            "images": List(Image()),
            "turns": List(
                {
                    "index": Value("int32"),
                    "step": Value("int32"),
                    "text": Value("string"),
                    "actions": Value("string"),  # JSON: the agent's actions of the turn
                    "output_ids": List(Value("int64")),
                    "logprobs": List(Value("float32")),
                    "versions": List(Value("int32")),
                }
            ),
            "rows": List(
                {
                    "input_ids": List(Value("int64")),
                    "loss_mask": List(Value("int8")),
                    "logprobs": List(Value("float32")),
                    "versions": List(Value("int32")),
                    "image_indices": List(Value("int32")),
                    "turns": List(Value("int32")),
                }
            ),
        }
    )


def _sampled_runs(row: StoredRow) -> list[tuple[int, int]]:
    """(start, end) of each run of sampled tokens: one per turn the row trains, in order."""
    runs, start = [], None
    for i, m in enumerate([*row.loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _turn_tokens(ep: StoredEpisode) -> dict[int, dict[str, list]]:
    out: dict[int, dict[str, list]] = {}
    for row in ep.rows:
        runs = _sampled_runs(row)
        if len(runs) != len(row.turns):  # a turn sampled no token: cannot tell them apart
            continue
        for (a, b), index in zip(runs, row.turns, strict=True):
            out[index] = {
                "output_ids": row.input_ids[a:b],
                "logprobs": row.logprobs[a:b],
                "versions": row.versions[a:b],
            }
    return out


def to_record(ep: StoredEpisode) -> tuple[dict[str, Any] | None, str | None]:
    """One dataset record of ``ep`` (its images in hand), or None and the reason to skip it."""
    last = ep.rows[-1]
    if last.messages is None:
        return None, "no_messages"
    placeholders = sum(p.get("type") == "image" for m in last.messages for p in m["content"])
    if placeholders != len(last.images):
        return None, "image_placeholders"
    order = list(last.images) + [h for h in ep.image_hashes if h not in last.images]
    first = {}
    for i, h in enumerate(order):
        first.setdefault(h, i)
    reply = ep.turns[-1]["text"] if ep.turns else None
    messages = [
        {
            "role": m["role"],
            "content": [{"type": p["type"], "text": p.get("text")} for p in m["content"]],
        }
        for m in last.messages
    ]
    if reply is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
    tokens = _turn_tokens(ep)
    empty = {"output_ids": [], "logprobs": [], "versions": []}
    return {
        "episode_id": ep.episode_id,
        "rollout_uuid": ep.rollout_uuid,
        "training": ep.training,
        "task_id": ep.task_id,
        "reward": ep.reward,
        "success": ep.success,
        "version_min": ep.version_min,
        "version_max": ep.version_max,
        "messages": messages,
        "images": [{"bytes": ep.images[h], "path": None} for h in order],
        "turns": [
            {
                "index": t["index"],
                "step": t["step"],
                "text": t.get("text"),
                "actions": json.dumps(t.get("actions") or []),
                **tokens.get(t["index"], empty),
            }
            for t in ep.turns
        ],
        "rows": [
            {
                "input_ids": r.input_ids,
                "loss_mask": r.loss_mask,
                "logprobs": r.logprobs,
                "versions": r.versions,
                # The last row's images are the first ones, in its order (duplicates kept).
                "image_indices": (
                    list(range(len(r.images))) if r is last else [first[h] for h in r.images]
                ),
                "turns": list(r.turns),
            }
            for r in ep.rows
        ],
    }, None


def episode_from_record(record: dict[str, Any]) -> StoredEpisode:
    """A dataset record back as a ``StoredEpisode`` with its images (for ``rebuild_rows``).
    ``record["images"]`` holds the images undecoded (``Image(decode=False)``: their bytes)."""
    import hashlib

    raw = [img["bytes"] for img in record["images"]]
    hashes = [hashlib.sha256(b).hexdigest() for b in raw]
    return StoredEpisode(
        task_id=record["task_id"],
        episode_id=record["episode_id"],
        rollout_uuid=record["rollout_uuid"],
        training=record["training"],
        reward=record["reward"],
        success=record["success"],
        version_min=record["version_min"],
        version_max=record["version_max"],
        rows=[
            StoredRow(
                input_ids=list(r["input_ids"]),
                loss_mask=list(r["loss_mask"]),
                logprobs=list(r["logprobs"]),
                versions=list(r["versions"]),
                images=tuple(hashes[i] for i in r["image_indices"]),
                turns=tuple(r["turns"]),
            )
            for r in record["rows"]
        ],
        images=dict(zip(hashes, raw, strict=True)),
    )


def _open(db: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    return conn


def _known_trainings(conn: sqlite3.Connection) -> list[str]:
    return [r[0] for r in conn.execute("SELECT run_name FROM training ORDER BY id DESC LIMIT 20")]


def _episodes(
    db: str,
    shots: str,
    training: str,
    success_only: bool,
    min_reward: float | None,
    report: ExportReport,
    progress: Callable[[str], None],
    total: int,
) -> Iterator[dict[str, Any]]:
    conn = _open(Path(db))
    try:
        yield from _records(
            conn, Path(shots), training, success_only, min_reward, report, progress, total
        )
    finally:
        conn.close()


def _records(conn, shots, training, success_only, min_reward, report, progress, total):
    seen = 0
    for row in store.training_episodes(
        conn, training, success_only=success_only, min_reward=min_reward
    ):
        seen += 1
        if seen % PROGRESS_EVERY == 0:
            progress(f"export: {seen}/{total} episodes read, {report.episodes} written")
        ep = episode_from_json(store.to_json(row))
        missing = False
        for h in ep.image_hashes:
            path = shots / h[:2] / h
            if not path.is_file():
                missing = True
                break
            ep.images[h] = path.read_bytes()
        if missing:
            report.skipped["image_missing"] += 1
            continue
        record, reason = to_record(ep)
        if record is None:
            report.skipped[reason] += 1
            continue
        report.episodes += 1
        report.rows += len(ep.rows)
        report.images += len(record["images"])
        yield record


def export_training(
    db: str | Path,
    training: str,
    out: str | Path,
    *,
    success_only: bool = False,
    min_reward: float | None = None,
    screenshots: str | Path | None = None,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> ExportReport:
    """Write the dataset of ``training``'s stored episodes to ``out``; ``ExportError`` when
    there is nothing to write (the message says why)."""
    from datasets import Dataset

    db = Path(db)
    if not db.is_file():
        raise ExportError(f"no database at {db}")
    conn = _open(db)
    try:
        try:
            store.require_store(conn)
        except store.NoEpisodeStore as exc:
            raise ExportError(str(exc)) from None
        tid = conn.execute("SELECT id FROM training WHERE run_name = ?", (training,)).fetchone()
        if tid is None:
            known = ", ".join(_known_trainings(conn)) or "none"
            raise ExportError(f"no training named {training!r} in {db} (newest: {known})")
        stored_n, successes = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(success), 0) FROM episode_store WHERE training_id = ?",
            (tid[0],),
        ).fetchone()
        where, params = "training_id = ?", [tid[0]]
        if success_only:
            where += " AND success = 1"
        if min_reward is not None:
            where += " AND reward >= ?"
            params.append(float(min_reward))
        total = conn.execute(f"SELECT COUNT(*) FROM episode_store WHERE {where}", params)
        total = total.fetchone()[0]
        if total == 0:
            raise ExportError(
                f"training {training!r} has {stored_n} stored episode(s), {successes} of them "
                f"successes; none matches the filters (success_only={success_only}, "
                f"min_reward={min_reward}). Episodes are stored per monitor.store_episodes "
                "(successes by default; all to keep failures too)"
            )
        report = ExportReport()
        shots = Path(screenshots) if screenshots else default_root(db)
        progress(f"export: {total} episode(s) of {training!r} to {out}")
        with tempfile.TemporaryDirectory(prefix="cua-export-") as cache:
            # Written to an Arrow file as it goes (memory bounded by one episode), then saved.
            ds = Dataset.from_generator(
                _episodes,
                features=features(),
                cache_dir=cache,
                gen_kwargs={
                    "db": str(db),
                    "shots": str(shots),
                    "training": training,
                    "success_only": success_only,
                    "min_reward": min_reward,
                    "report": report,
                    "progress": progress,
                    "total": total,
                },
            )
            if report.episodes == 0:
                raise ExportError(
                    f"none of the {total} matching episode(s) could be exported: skipped "
                    f"{dict(report.skipped)}"
                )
            ds.save_to_disk(str(out))
        progress(
            f"export: wrote {report.episodes} episode(s), {report.rows} row(s), "
            f"{report.images} image(s) to {out}; skipped {dict(report.skipped) or 0}"
        )
        return report
    finally:
        conn.close()
