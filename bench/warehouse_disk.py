"""The trajectory warehouse's disk cost per stored episode, and what rebuilding its rows costs.

Episodes of N turns with a new phone screenshot (1080x2400 PNG) at every step, as
``bench/context_rows.py`` builds them (40 sampled tokens per turn, Qwen2-VL's released pixel
budget; the logprobs are random, so the blob compresses as real ones do), per context policy
(``full``: one row; ``current``: one row per turn). Each is converted by ``convert_turns``,
stored as the workflow stores it (``stored_episode_of``), ingested into a real monitor database
and screenshot store on a temp folder, and rebuilt with ``rebuild_rows``. Printed per case: the
``episode_store`` row (token blob, row/turn metadata), the database file's growth, the
screenshots the model received (stored once: what an episode adds when none of its images was
stored before), the dashboard's downscaled WebP copy of the same screenshots for comparison, the
rows' ``pixel_values`` (what storing the rows themselves would take) and the rebuild's CPU time.
Not a timed test.

    .venv/bin/python bench/warehouse_disk.py [--turns 10] [--policies full current]

(about a minute on a 2-core machine; longer episodes under the shared heavy lock).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

KIB, MIB = 1024, 1 << 20
COPIES = 8  # episodes stored per case: the database grows by whole pages


def db_bytes(path: Path) -> int:
    """The database's bytes with its WAL checkpointed into it."""
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages, size = (
            db.execute("PRAGMA page_count").fetchone()[0],
            db.execute("PRAGMA page_size").fetchone()[0],
        )
    return pages * size


def measure(policy: str, turns: int, proc) -> dict:
    from context_rows import episode

    from cua_rl.monitor.protocol import EPISODE_KIND, step_client_id
    from cua_rl.monitor.server.screenshots import ScreenshotStore
    from cua_rl.monitor.server.store import MonitorStore
    from cua_rl.monitor.worker.uploader import prepare_screenshot
    from cua_rl.trajectory import convert_turns
    from cua_rl.warehouse import rebuild_rows, stored_episode_of, to_record

    rng = random.Random(turns)
    turns_, images = episode(policy, turns, proc)
    for t in turns_:
        t.output_logprobs = [-rng.expovariate(2.0) for _ in t.output_ids]
    res = convert_turns(
        turns_, processor=proc, reward=1.0, version=0, fetched_images=images, episode_id=1
    )
    assert res.ok, (res.reason, res.detail)
    ep = stored_episode_of(
        res, turns_, task_id="t", rollout_uuid="r", training="bench", success=True
    )
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "monitor.db"
        store = MonitorStore(db)
        uuids = [f"r{i}" for i in range(COPIES)]
        store.ingest(
            {
                "training": {"run_name": "bench", "log_path": "l", "model_name": "m"},
                "tasks": [{"client_id": "t", "task_id": "t", "name": "t", "description": ""}],
                "steps": [{"client_id": step_client_id("bench", 1), "training_client_id": "bench",
                           "step": 1}],
                "rollouts": [{"client_id": u, "rollout_id": u, "source_type": "step",
                              "step_client_id": step_client_id("bench", 1),
                              "task_client_id": "t", "model_path": "m", "status": "completed"}
                             for u in uuids],
            }
        )  # fmt: skip
        store.close()
        before = db_bytes(db)
        store = MonitorStore(db)
        for u in uuids:  # the same episode under several rollouts: the growth is per episode
            ep.rollout_uuid = u
            store.ingest({EPISODE_KIND: [to_record(ep)]})
        row_bytes = store.read.conn().execute("SELECT MAX(bytes) FROM episode_store").fetchone()[0]
        store.close()
        grown = (db_bytes(db) - before) / COPIES
        store = MonitorStore(db)
        shots = ScreenshotStore(db, max_image_bytes=16 * MIB)
        for digest, data in ep.images.items():
            shots.put(digest, data)
        raw = shots.stats()["bytes"]
        shots.close()
        store.close()
    webp = sum(len(prepare_screenshot(b).data) for b in ep.images.values())
    pixels = sum(r["multi_modal_input"][0]["pixel_values"].numel() * 4 for r in res.rows)
    start = time.process_time()
    rebuild_rows(ep, proc)
    rebuild_s = time.process_time() - start
    return {
        "policy": policy,
        "turns": turns,
        "rows": len(ep.rows),
        "tokens": ep.tokens,
        "record_kib": row_bytes / KIB,
        "db_kib": grown / KIB,
        "images": len(ep.images),
        "raw_mib": raw / MIB,
        "webp_mib": webp / MIB,
        "pixel_mib": pixels / MIB,
        "rebuild_s": rebuild_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[10])
    parser.add_argument("--policies", nargs="+", default=["full", "current"])
    args = parser.parse_args(argv)
    import torch
    from context_rows import processor

    torch.set_num_threads(1)
    proc = processor()
    print(
        "| policy | turns | rows | tokens | episode_store row KiB | db growth KiB | "
        "screenshots | as received MiB | dashboard WebP MiB | rows' pixel_values MiB | "
        "pixel_values / stored | rebuild CPU s |"
    )
    print("|---" * 12 + "|")
    for policy in args.policies:
        for turns in args.turns:
            m = measure(policy, turns, proc)
            stored = m["db_kib"] / 1024 + m["raw_mib"]
            print(
                f"| {m['policy']} | {m['turns']} | {m['rows']} | {m['tokens']} | "
                f"{m['record_kib']:.1f} | {m['db_kib']:.1f} | {m['images']} | "
                f"{m['raw_mib']:.2f} | {m['webp_mib']:.2f} | {m['pixel_mib']:.0f} | "
                f"{m['pixel_mib'] / stored:.0f}x | {m['rebuild_s']:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
