"""What an export holds and costs per context policy: examples, images and bytes per 100
episodes, and export time per 1,000 episodes, on episodes of real local trainings.

Per policy (the full conversation, MAI-UI's window, the current screenshot only) it takes the
monitor database of a real local training that stored every episode: ``--db POLICY=PATH``, or a
run of ``make demo``'s launcher it starts (``agent.context=POLICY agent.max_steps=5
monitor.store_episodes=all total_train_steps=1``, the evaluations off; about 3 minutes each on a
2-core machine). It exports the training's episodes as Arrow and as Parquet and prints, per 100
episodes, the examples (trained rows), the images they hold (and those images' bytes as
received) and the folder's bytes. Then it stores copies of those episodes under new rollouts
through the monitor's ingest until the training holds ``--episodes`` (1,000) of them, and times
``export_episodes`` on them, Arrow and Parquet (wall and CPU seconds; the images are the same
files again, so the page cache is warm).
Not a timed test.

    .venv/bin/python bench/export_sizes.py [--db full=runs/a/monitor.db ...] [--episodes 1000]
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLICIES = ("full", "mai-ui", "current")
MIB = 1 << 20
DEMO_ARGS = (
    "agent.max_steps=5",
    "monitor.store_episodes=all",
    "total_train_epochs=1",
    "total_train_steps=1",
    "gym.selection.train_ratio=1.0",
    "gym.selection.eval_number_range=null",
)


def demo_db(policy: str, folder: Path) -> Path:
    """A real local training under ``policy`` with every episode stored; its database."""
    run_dir = folder / policy
    cmd = [sys.executable, "-m", "cua_rl.app.demo", "--quiet", "--run-dir", str(run_dir)]
    done = subprocess.run(
        [*cmd, f"agent.context={policy}", *DEMO_ARGS], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"the {policy} training failed:\n{done.stdout[-3000:]}")
    return run_dir / "monitor.db"


def export(db: Path, out: Path, fmt: str):
    from cua_rl.monitor.export import Filters, export_episodes

    wall, cpu = time.perf_counter(), time.process_time()
    report = export_episodes(db, out, Filters(), fmt=fmt, progress=lambda line: None)
    return report, time.perf_counter() - wall, time.process_time() - cpu


def grow(db: Path, target: int) -> int:
    """Store copies of the training's episodes under new rollouts of its first step, through
    ingest, until it holds ``target``; returns how many it holds."""
    from cua_rl.monitor.protocol import EPISODE_KIND, step_client_id
    from cua_rl.monitor.server import episodes
    from cua_rl.monitor.server.store import MonitorStore

    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    records = [episodes.to_json(r) for r in conn.execute(
        "SELECT es.*, r.rollout_id AS rollout_uuid, NULL AS training FROM episode_store es "
        "JOIN rollout r ON r.id = es.rollout_id ORDER BY es.id"
    )]  # fmt: skip
    run, number = conn.execute(
        "SELECT t.run_name, s.step FROM step s JOIN training t ON t.id = s.training_id "
        "JOIN rollout r ON r.step_id = s.id JOIN episode_store es ON es.rollout_id = r.id LIMIT 1"
    ).fetchone()
    step = step_client_id(run, number)
    conn.close()
    store = MonitorStore(db)
    held = len(records)
    while held < target:
        base = records[held % len(records)]
        uuid = f"bench-copy-{held}"
        rollout = {"client_id": uuid, "rollout_id": uuid, "source_type": "step",
                   "step_client_id": step, "task_client_id": base["task_id"], "model_path": "m",
                   "status": "completed"}  # fmt: skip
        copy = {k: v for k, v in base.items() if k not in ("id", "training", "bytes")}
        copy.update(client_id=f"{uuid}:episode", rollout_client_id=uuid)
        store.ingest({"rollouts": [rollout], EPISODE_KIND: [copy]})
        held += 1
    store.close()
    return held


def measure(policy: str, db: Path, episodes: int, tmp: Path) -> dict:
    work = tmp / f"{policy}-work"
    work.mkdir()
    src, dst = sqlite3.connect(db), sqlite3.connect(work / "monitor.db")
    try:
        src.backup(dst)  # what the WAL holds too: the monitor that wrote it may not have folded it
    finally:
        src.close()
        dst.close()
    shutil.copytree(db.parent / "monitor.screenshots", work / "monitor.screenshots")
    db = work / "monitor.db"
    out = {"policy": policy}
    for fmt in ("arrow", "parquet"):
        report, _, _ = export(db, tmp / f"{policy}-{fmt}", fmt)
        per = 100 / report.episodes
        out.update(episodes=report.episodes, examples=report.examples * per)
        out.update(images=report.images * per, image_mib=report.image_bytes * per / MIB)
        out[f"{fmt}_mib"] = report.bytes * per / MIB
    grow(db, episodes)
    for fmt in ("arrow", "parquet"):
        report, wall, cpu = export(db, tmp / f"{policy}-{fmt}-timed", fmt)
        out[f"{fmt}_wall"] = wall * 1000 / report.episodes
        out[f"{fmt}_cpu"] = cpu * 1000 / report.episodes
        shutil.rmtree(tmp / f"{policy}-{fmt}-timed")
    out["timed"] = f"{report.episodes} ep, {report.examples} ex, {report.bytes / MIB:.0f} MiB"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", action="append", default=[], help="POLICY=PATH (repeatable)")
    parser.add_argument("--episodes", type=int, default=1000)
    args = parser.parse_args(argv)
    given = dict(item.split("=", 1) for item in args.db)
    import datasets

    datasets.disable_progress_bars()  # the table is the output
    print(
        "| policy | episodes read | examples / 100 ep | images / 100 ep | of which image MiB | "
        "Arrow MiB / 100 ep | "
        "Parquet MiB / 100 ep | Arrow export s / 1,000 ep (CPU) | "
        "Parquet export s / 1,000 ep (CPU) | timed export (Parquet) |"
    )
    print("|---" * 10 + "|")
    with tempfile.TemporaryDirectory(prefix="export-bench-") as tmp:
        tmp = Path(tmp)
        for policy in POLICIES:
            db = Path(given[policy]) if policy in given else demo_db(policy, tmp / "runs")
            m = measure(policy, db, args.episodes, tmp)
            print(
                f"| {policy} | {m['episodes']} | {m['examples']:.0f} | {m['images']:.0f} | "
                f"{m['image_mib']:.2f} | "
                f"{m['arrow_mib']:.2f} | {m['parquet_mib']:.2f} | "
                f"{m['arrow_wall']:.1f} ({m['arrow_cpu']:.1f}) | "
                f"{m['parquet_wall']:.1f} ({m['parquet_cpu']:.1f}) | {m['timed']} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
