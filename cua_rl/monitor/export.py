"""``python -m cua_rl.monitor export``: stored episodes as a Hugging Face dataset, one example per
trained row (docs/warehouse.md, *Export*).

Reads the trajectory warehouse of a monitor database offline (``episode_store``, the screenshot
store beside it), selects the episodes the filters name (trainings, successes only, a reward
floor, a context policy, a range of training steps), and turns each into its examples with
``cua_rl.warehouse.examples`` (the assistant turn decoded by the training's own tokenizer, a
local folder: the run's ``tokenizer_path`` unless ``tokenizer`` names another). The examples are
written to an Arrow file as they come (memory bounded by one episode), then saved with
``save_to_disk`` or as Parquet, beside a dataset card (``README.md``, ``export_card.py``). What is
left out is counted by reason and printed. ``rollout_examples`` gives one rollout's examples, the
same records, which the dashboard's rollout page offers as a Parquet file.
"""

from __future__ import annotations

import functools
import io
import json
import sqlite3
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cua_rl.errors import CuaRlError
from cua_rl.monitor.server import episodes as store
from cua_rl.monitor.server.screenshots import default_root
from cua_rl.warehouse.episode import StoredEpisode, episode_from_json
from cua_rl.warehouse.examples import (
    EPISODE_SKIPS,
    OWN_CONTEXT,
    ROW_SKIPS,
    examples_of,
    features,
)

PROGRESS_EVERY = 100
FORMATS = ("arrow", "parquet")
# Where --format parquet writes its one file (the Hub's layout; the card's `configs` names it).
PARQUET_FILE = "data/train-00000-of-00001.parquet"


class ExportError(CuaRlError, ValueError):
    """The export cannot run: the message says why and what to change."""


@dataclass(frozen=True)
class Filters:
    """Which stored episodes to export. ``trainings``: run names (empty: every training with
    stored episodes); ``context``: only trainings whose agent ran this context policy; the
    step range is the training step the episode was sampled for, both ends included."""

    trainings: tuple[str, ...] = ()
    success_only: bool = False
    min_reward: float | None = None
    context: str | None = None
    min_step: int | None = None
    max_step: int | None = None

    def describe(self) -> str:
        said = [f"training {', '.join(self.trainings)}"] if self.trainings else []
        said += ["successes only"] if self.success_only else []
        said += [f"reward >= {self.min_reward:g}"] if self.min_reward is not None else []
        said += [f"context {self.context}"] if self.context is not None else []
        if self.min_step is not None or self.max_step is not None:
            said.append(f"training steps {self.min_step or 0}..{self.max_step or 'end'}")
        return "; ".join(said) or "none"


@dataclass
class ExportReport:
    matched: int = 0  # episodes the filters selected
    episodes: int = 0  # episodes that gave at least one example
    examples: int = 0
    images: int = 0
    image_bytes: int = 0  # the examples' images as received, each time an example holds one
    bytes: int = 0  # the written folder, card included
    skipped_episodes: Counter = field(default_factory=Counter)
    skipped_rows: Counter = field(default_factory=Counter)
    sources: list[dict] = field(default_factory=list)  # the trainings exported

    def add(self, records: list[dict], skipped: Counter) -> None:
        self.skipped_rows.update(skipped)
        if records:
            self.episodes += 1
            self.examples += len(records)
            self.images += sum(len(r["images"]) for r in records)
            self.image_bytes += sum(len(i["bytes"]) for r in records for i in r["images"])

    def skip_lines(self) -> list[str]:
        """One line per reason: how many, of what, and why."""
        lines = []
        for unit, counts, why in (
            ("episode", self.skipped_episodes, EPISODE_SKIPS),
            ("row", self.skipped_rows, ROW_SKIPS),
        ):
            for reason, n in sorted(counts.items()):
                lines.append(f"skipped {n} {unit}(s): {reason} ({why[reason]})")
        return lines


def _config(row: sqlite3.Row) -> dict:
    try:
        cfg = json.loads(row["config_json"] or "{}")
    except ValueError:
        cfg = {}
    return cfg if isinstance(cfg, dict) else {}


def _source(row: sqlite3.Row, tokenizer: str | None) -> dict[str, Any]:
    """What a training gives its examples, and where its tokenizer is."""
    cfg = _config(row)
    agent, actor = cfg.get("agent") or {}, cfg.get("actor") or {}
    return {
        "id": row["id"],
        "training": row["run_name"],
        "model": row["model_name"],
        "context": agent.get("context") or "",
        "tokenizer": tokenizer or cfg.get("tokenizer_path") or actor.get("path") or "",
        "stored": row["stored"],
        "successes": row["successes"],
    }


_TRAININGS = """
SELECT t.id, t.run_name, t.model_name, t.config_json,
    (SELECT COUNT(*) FROM episode_store es WHERE es.training_id = t.id) AS stored,
    (SELECT COALESCE(SUM(es.success), 0) FROM episode_store es WHERE es.training_id = t.id)
        AS successes
FROM training t
"""


def _sources(conn: sqlite3.Connection, filters: Filters, tokenizer: str | None) -> list[dict]:
    rows = list(conn.execute(f"{_TRAININGS} ORDER BY t.id DESC"))
    by_name = {r["run_name"]: r for r in rows}
    for name in filters.trainings:
        if name not in by_name:
            known = ", ".join(r["run_name"] for r in rows[:20]) or "none"
            raise ExportError(f"no training named {name!r} (newest: {known})")
    chosen = [by_name[n] for n in filters.trainings] or [r for r in rows if r["stored"]]
    if not chosen:
        raise ExportError(
            "no training has stored episodes: episodes are stored per monitor.store_episodes "
            "(successes by default; all to keep failures too)"
        )
    sources = [_source(r, tokenizer) for r in chosen]
    if filters.context is None:
        return sources
    kept = [s for s in sources if s["context"] == filters.context]
    if not kept:
        ran = ", ".join(f"{s['training']}: {s['context'] or OWN_CONTEXT}" for s in sources)
        raise ExportError(f"no training ran with context {filters.context!r} ({ran})")
    return kept


@functools.lru_cache(maxsize=8)
def decoder(path: str) -> Callable[[Sequence[int]], str]:
    """The sampled ids as text, with the tokenizer in the local folder ``path`` (never a
    download). A trailing stop token is left out, as the chat template writes one after the
    assistant turn itself; special tokens sampled inside the reply are kept."""
    folder = Path(path) if path else None
    if folder is None or not folder.is_dir():
        raise ExportError(
            f"the training's tokenizer {path!r} is not a folder here: pass --tokenizer DIR "
            "(the model the training trained, or one with the same tokenizer)"
        )
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    stops = {tok.eos_token_id}
    if (folder / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(str(folder), local_files_only=True).eos_token_id
        stops.update(eos if isinstance(eos, list) else [eos])
    stops.discard(None)

    def decode(ids: Sequence[int]) -> str:
        ids = list(ids)
        if ids and ids[-1] in stops:
            ids.pop()
        return tok.decode(ids, skip_special_tokens=False)

    return decode


def _open(db: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    return conn


def _with_images(ep: StoredEpisode, shots: Path) -> bool:
    """Fill ``ep.images`` from the screenshot store; False when one is missing."""
    for h in ep.image_hashes:
        path = shots / h[:2] / h
        if not path.is_file():
            return False
        ep.images[h] = path.read_bytes()
    return True


def episode_examples(
    row: sqlite3.Row, shots: Path, source: dict[str, Any], report: ExportReport
) -> list[dict[str, Any]]:
    """The examples of one stored episode (``export_episodes``' row), counted in ``report``."""
    ep = episode_from_json(store.to_json(row))
    if not _with_images(ep, shots):
        report.skipped_episodes["image_missing"] += 1
        return []
    records, skipped = examples_of(
        ep, decoder(source["tokenizer"]), {**source, "training_step": row["training_step"]}
    )
    report.add(records, skipped)
    return records


def _records(
    db: str, shots: str, where: str, params: tuple, sources: tuple[dict, ...], report, progress
) -> Iterator[dict[str, Any]]:
    by_id = {s["id"]: s for s in sources}
    conn = _open(Path(db))
    try:
        for n, row in enumerate(store.export_episodes(conn, where, params), 1):
            if n % PROGRESS_EVERY == 0:
                progress(f"export: {n}/{report.matched} episodes read, {report.examples} examples")
            yield from episode_examples(row, Path(shots), by_id[row["training_id"]], report)
    finally:
        conn.close()


def _folder_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def _select(conn: sqlite3.Connection, db: Path, filters: Filters, tokenizer: str | None):
    """(the trainings, the WHERE clause and its parameters, the matching count)."""
    try:
        store.require_store(conn)
    except store.NoEpisodeStore as exc:
        raise ExportError(str(exc)) from None
    sources = _sources(conn, filters, tokenizer)
    where, params = store.export_filter(
        [s["id"] for s in sources],
        success_only=filters.success_only,
        min_reward=filters.min_reward,
        min_step=filters.min_step,
        max_step=filters.max_step,
    )
    total = store.count_episodes(conn, where, params)
    if total == 0:
        held = ", ".join(
            f"{s['training']}: {s['stored']} stored, {s['successes']} successes" for s in sources
        )
        raise ExportError(
            f"no stored episode matches the filters ({filters.describe()}); {held}. Episodes "
            "are stored per monitor.store_episodes (successes by default; all to keep failures)"
        )
    for source in sources:
        decoder(source["tokenizer"])  # a missing tokenizer is an error before anything is written
    return sources, where, params, total


def export_episodes(
    db: str | Path,
    out: str | Path,
    filters: Filters,
    *,
    fmt: str = "arrow",
    screenshots: str | Path | None = None,
    tokenizer: str | None = None,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> ExportReport:
    """Write the examples of the stored episodes ``filters`` selects to the folder ``out``
    (``fmt``: arrow, datasets' ``save_to_disk``; or parquet), with its dataset card;
    ``ExportError`` when there is nothing to write (the message says why)."""
    from datasets import Dataset

    from cua_rl.monitor.export_card import write_card

    db, out = Path(db), Path(out)
    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r}: use one of {', '.join(FORMATS)}")
    if not db.is_file():
        raise ExportError(f"no database at {db}")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty: name a new folder")
    conn = _open(db)
    try:
        sources, where, params, total = _select(conn, db, filters, tokenizer)
    finally:
        conn.close()
    report = ExportReport(matched=total, sources=sources)
    shots = Path(screenshots) if screenshots else default_root(db)
    progress(f"export: {total} episode(s) match ({filters.describe()}); writing {out}")
    with tempfile.TemporaryDirectory(prefix="cua-export-") as cache:
        ds = Dataset.from_generator(
            _records,
            features=features(),
            cache_dir=cache,
            # Tuples: datasets splits the lists of gen_kwargs into shards, one generator each.
            gen_kwargs={
                "db": str(db),
                "shots": str(shots),
                "where": where,
                "params": tuple(params),
                "sources": tuple(sources),
                "report": report,
                "progress": progress,
            },
        )
        if report.examples == 0:
            raise ExportError(
                f"none of the {total} matching episode(s) gave an example: "
                + "; ".join(report.skip_lines())
            )
        _write(ds, out, fmt)
    write_card(out, report, filters, fmt)
    report.bytes = _folder_bytes(out)
    _summary(report, out, fmt, progress)
    return report


def _write(ds, out: Path, fmt: str) -> None:
    if fmt == "arrow":
        ds.save_to_disk(str(out))
        return
    path = out / PARQUET_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(path))


def _summary(report: ExportReport, out: Path, fmt: str, progress) -> None:
    skipped = sum(report.skipped_episodes.values()) + sum(report.skipped_rows.values())
    progress(
        f"export: wrote {report.examples} example(s) of {report.episodes} episode(s), "
        f"{report.images} image(s), {report.bytes / 2**20:.2f} MiB to {out} ({fmt}); "
        f"{skipped or 'nothing'} skipped"
    )
    for line in report.skip_lines():
        progress(f"export: {line}")


def export_training(
    db: str | Path, training: str | Sequence[str], out: str | Path, **options: Any
) -> ExportReport:
    """``export_episodes`` for the named training(s); ``options``: the ``Filters`` fields
    (``success_only``, ``min_reward``, ``context``, ``min_step``, ``max_step``) and
    ``export_episodes``' keywords."""
    names = (training,) if isinstance(training, str) else tuple(training)
    keys = {"success_only", "min_reward", "context", "min_step", "max_step"}
    filters = Filters(trainings=names, **{k: v for k, v in options.items() if k in keys})
    rest = {k: v for k, v in options.items() if k not in keys}
    return export_episodes(db, out, filters, **rest)


def rollout_examples(
    conn: sqlite3.Connection, shots: Path, rollout_id: int, tokenizer: str | None = None
) -> list[dict[str, Any]]:
    """The examples of rollout ``rollout_id``'s stored episode: the records the export writes
    for it. ``ExportError`` when it has none (the message says why)."""
    try:
        store.require_store(conn)
    except store.NoEpisodeStore as exc:
        raise ExportError(str(exc)) from None
    found = list(store.export_episodes(conn, "es.rollout_id = ?", [rollout_id]))
    if not found:
        raise ExportError(f"rollout {rollout_id} has no stored episode (monitor.store_episodes)")
    training = conn.execute(f"{_TRAININGS} WHERE t.id = ?", (found[0]["training_id"],))
    training = training.fetchone()
    if training is None:
        raise ExportError(f"rollout {rollout_id}'s stored episode names no training")
    report = ExportReport(matched=1)
    records = episode_examples(found[0], shots, _source(training, tokenizer), report)
    if not records:
        raise ExportError(
            f"rollout {rollout_id} gives no example: {'; '.join(report.skip_lines())}"
        )
    return records


def parquet_bytes(records: list[dict[str, Any]]) -> bytes:
    """``records`` as one Parquet file with the export's features (images as their bytes)."""
    from datasets import Dataset

    buf = io.BytesIO()
    Dataset.from_list(records, features=features()).to_parquet(buf)
    return buf.getvalue()
