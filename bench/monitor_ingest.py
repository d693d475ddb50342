"""Training Monitor throughput and read latency, through the real HTTP API.

1. Ingest: starts ``python -m cua_rl.monitor serve`` on a fresh file database (free loopback
   port) and posts batches of turns (with their rollouts, and one action per turn) to
   ``POST /api/ingest/batch``; prints turns/s, records/s and the batch size. Goal: >= 5,000
   turns/s. Then the same through ``MonitorClient`` (enqueue -> background batches), the path
   training uses.
2. Reads: builds a database of ``--turns`` turns (default 1,000,000) by bulk SQL inserts into a
   store's schema (triggers and indexes on, as in production), starts the server on it and
   prints the p50/p95 latency of each dashboard read endpoint over ``--samples`` requests on
   random ids. Goal: p95 < 100 ms.
3. Pages: on the same database, the p50/p95 server-side render time of each dashboard page
   (queries plus template, from the ``Server-Timing`` header of real HTTP requests). Goal: p95
   < 200 ms.
4. Screenshots: bytes per turn of the screenshot store. The local gym's phone screens (the
   sim's 360x640, and 1080x2400 as a real phone's) go through the recorder's preparation
   (long edge <= 1024 px, WebP) and are uploaded to a real server over HTTP as episodes of
   ``--shot-turns`` turns would; prints source and stored bytes per turn (the store keeps an
   image once, so repeated screens cost nothing more).

    python bench/monitor_ingest.py [--turns 1000000] [--ingest-turns 50000] [--batch-turns 1000]
        [--samples 200] [--shot-turns 300] [--only ingest,reads,pages,shots] [--workdir DIR]
        [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cua_rl.monitor.server.store import MonitorStore  # noqa: E402
from cua_rl.monitor.worker.client import MonitorClient, MonitorClientConfig  # noqa: E402
from cua_rl.monitor.worker.context import MonitorContext  # noqa: E402

TOKEN = "bench-token"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, db: Path):
        self.db, self.port = db, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        cmd = [sys.executable, "-m", "cua_rl.monitor", "serve", "--db", str(self.db)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--token", TOKEN]
        cmd += ["--max-body-bytes", str(64 << 20)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
        for _ in range(300):
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError("monitor did not start")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


# ---------------------------------------------------------------------------------- ingest


def ingest_batches(run: str, total_turns: int, batch_turns: int, turns_per_rollout: int = 10):
    """Batches as the recorder sends them: rollouts, their turns and one action per turn, all
    referencing each other by client id."""
    step = f"step-{run}-1-0"
    head = {
        "training": {"client_id": run, "run_name": run, "log_path": "l", "model_name": "m"},
        "tasks": [{"client_id": "t0", "task_id": "t0", "name": "n", "description": "d"}],
        "steps": [{"client_id": step, "training_client_id": run, "step": 1, "batch": 0}],
    }
    batches, made, r = [head], 0, 0
    while made < total_turns:
        batch: dict = {"rollouts": [], "turns": [], "actions": []}
        while len(batch["turns"]) < batch_turns and made < total_turns:
            uuid = f"{run}-r{r}"
            r += 1
            batch["rollouts"].append(
                {
                    "client_id": uuid,
                    "rollout_id": uuid,
                    "step_client_id": step,
                    "task_client_id": "t0",
                    "model_path": "m",
                    "status": "running",
                }
            )
            for n in range(turns_per_rollout):
                tid = f"{uuid}:turn:{n}"
                batch["turns"].append(
                    {
                        "client_id": tid,
                        "rollout_client_id": uuid,
                        "turn": n,
                        "model_response": "tap(100, 200)",
                        "metrics_json": {"model_s": 0.4},
                    }
                )
                batch["actions"].append(
                    {
                        "client_id": f"{tid}:action:0",
                        "turn_client_id": tid,
                        "tool_name": "tap",
                        "tool_args": {"x": 100, "y": 200},
                        "tokens": list(range(16)),
                        "logprobs": [-0.5] * 16,
                        "num_tokens": 16,
                    }
                )
                made += 1
        batches.append(batch)
    return batches


async def bench_http_ingest(url: str, pid: int, total_turns: int, batch_turns: int) -> None:
    batches = ingest_batches(f"bench-http-{os.getpid()}", total_turns, batch_turns)
    records = sum(1 if k == "training" else len(v) for b in batches for k, v in b.items())
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    # Encoded before the clock starts: this measures the server, not the bench's encoder.
    bodies = [orjson.dumps(b) for b in batches]
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
        cpu0 = server_cpu_s(pid)
        t0 = time.perf_counter()
        for body in bodies:  # one writer: SQLite serialises writes anyway
            resp = await http.post("/api/ingest/batch", content=body)
            resp.raise_for_status()
        dt = time.perf_counter() - t0
    cpu = server_cpu_s(pid) - cpu0
    rate = total_turns / dt
    print(
        f"ingest via HTTP ({len(bodies)} POSTs of {batch_turns} turns, bodies pre-encoded): "
        f"{total_turns} turns ({records} records) in {dt:.2f} s wall: {rate:,.0f} turns/s, "
        f"{records / dt:,.0f} records/s (goal >= 5,000 turns/s: {'met' if rate >= 5000 else 'NOT met'})"
    )
    print(
        f"  server CPU {cpu:.2f} s: {total_turns / cpu:,.0f} turns per server CPU-second "
        f"(wall/CPU {dt / cpu:.2f}; above 1 means the server waited for a core or the disk)"
    )


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc), to tell work from waiting."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench_client_ingest(url: str, total_turns: int, spool: Path) -> None:
    from cua_rl.monitor.worker.recorder import RolloutRecorder

    cfg = MonitorClientConfig(
        base_url=url,
        token=TOKEN,
        batch_max_records=2000,
        flush_interval_s=0.05,
        spool_path=str(spool),
    )
    run = f"bench-client-{os.getpid()}"
    async with MonitorClient(cfg) as client:
        t0 = time.perf_counter()
        client.training(run, log_path="l", model_name="m")
        step = client.step(run, 1)
        ctx = MonitorContext(training_id=run, step_id=step)
        made, r = 0, 0
        while made < total_turns:
            rec = RolloutRecorder(client, f"{run}-r{r}", task_id="t0", model_path="m", source=ctx)
            r += 1
            await rec.start()
            for n in range(10):
                await rec.turn_start(n)
                await rec.turn_end(n, model_response="tap(1, 2)", timings={"model_s": 0.4})
                await rec.action(
                    n, 0, "tap", {"x": 1, "y": 2}, tokens=list(range(16)), logprobs=[-0.5] * 16
                )
                made += 1
            await rec.complete(reward=1.0)
            if client.pending > 20_000:  # the trainer produces turns slower than this loop
                await asyncio.sleep(0.01)
        ok = await client.flush(timeout=600)
        dt = time.perf_counter() - t0
        c = client.counters
    print(
        f"ingest via MonitorClient + RolloutRecorder: {made} turns in {dt:.2f} s: "
        f"{made / dt:,.0f} turns/s (flushed={ok}, sent={c.sent}, retried={c.retried}, "
        f"spooled={c.spooled}, dropped={c.dropped})"
    )


# ---------------------------------------------------------------------------------- big db


def build_big_db(
    path: Path,
    turns: int,
    turns_per_rollout: int = 10,
    rollouts_per_step: int = 100,
    steps_per_training: int = 100,
) -> dict:
    """Bulk-insert a realistic tree of ``turns`` turns (1 action + 1 observation per turn)."""
    store = MonitorStore(path)  # creates the schema, triggers and indexes
    store.close()
    import sqlite3

    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("PRAGMA foreign_keys = OFF")  # ids are generated consistently below
    conn.execute("PRAGMA cache_size = -262144")
    n_rollouts = max(1, turns // turns_per_rollout)
    n_steps = max(1, -(-n_rollouts // rollouts_per_step))
    n_trainings = max(1, -(-n_steps // steps_per_training))
    ts = "2026-01-01 00:00:00"
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO training (id, run_name, log_path, model_name, status, total_steps) "
        "VALUES (?, ?, 'runs/x', 'tiny', 'running', ?)",
        [(t + 1, f"run-{t}", steps_per_training) for t in range(n_trainings)],
    )
    conn.execute("INSERT INTO task (id, task_id, name, description) VALUES (1, 't0', 'n', 'd')")
    conn.executemany(
        "INSERT INTO step (id, training_id, step, batch, status) VALUES (?, ?, ?, 0, 'completed')",
        [(s + 1, s // steps_per_training + 1, s % steps_per_training) for s in range(n_steps)],
    )
    conn.executemany(
        "INSERT INTO rollout (id, source_type, step_id, rollout_id, task_id, model_path, status, "
        "num_turns, reward) VALUES (?, 'step', ?, ?, 1, 'm', 'completed', ?, 1.0)",
        (
            (r + 1, r // rollouts_per_step + 1, f"u{r}", turns_per_rollout)
            for r in range(n_rollouts)
        ),
    )
    conn.executemany(
        "INSERT INTO client_key (entity_type, client_id, entity_id) VALUES ('rollout', ?, ?)",
        ((f"u{r}", r + 1) for r in range(n_rollouts)),
    )
    conn.executemany(
        "INSERT INTO turn (id, rollout_id, turn, start_time, model_response, metrics_json) "
        "VALUES (?, ?, ?, ?, 'tap(100, 200)', '{\"model_s\":0.4}')",
        ((i + 1, i // turns_per_rollout + 1, i % turns_per_rollout, ts) for i in range(turns)),
    )
    conn.executemany(
        "INSERT INTO client_key (entity_type, client_id, entity_id) VALUES ('turn', ?, ?)",
        ((f"u{i // turns_per_rollout}:turn:{i % turns_per_rollout}", i + 1) for i in range(turns)),
    )
    tokens = "[" + ",".join(str(x) for x in range(16)) + "]"
    logprobs = "[" + ",".join(["-0.5"] * 16) + "]"
    conn.executemany(
        "INSERT INTO action (turn_id, action_type, tool_name, tool_args, tokens, logprobs, "
        "num_tokens) VALUES (?, 'tap', 'tap', '{\"x\":100,\"y\":200}', ?, ?, 16)",
        ((i + 1, tokens, logprobs) for i in range(turns)),
    )
    # Each turn's screenshot is in the store (one row per image, as the upload path leaves it).
    conn.executemany(
        "INSERT INTO obs (turn_id, obs_type, screenshot_uri) VALUES (?, 'screenshot', ?)",
        ((i + 1, f"sha256:{i:064x}") for i in range(turns)),
    )
    conn.executemany(
        "INSERT INTO screenshot (sha256, mime, bytes, width, height, created_at) "
        "VALUES (?, 'image/webp', 30000, 461, 1024, ?)",
        ((f"{i:064x}", ts) for i in range(turns)),
    )
    conn.executemany(
        "INSERT INTO validation (rollout_id, success) VALUES (?, 1)",
        ((r + 1,) for r in range(n_rollouts)),
    )
    conn.executemany(
        "INSERT INTO environment (rollout_id, env_type, status) VALUES (?, 'android', 'terminated')",
        ((r + 1,) for r in range(n_rollouts)),
    )
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("ANALYZE")
    conn.close()
    return {"trainings": n_trainings, "steps": n_steps, "rollouts": n_rollouts, "turns": turns}


async def bench_reads(url: str, shape: dict, samples: int) -> list[tuple[str, float, float]]:
    rng = random.Random(0)
    endpoints = {
        "GET /api/trainings": lambda: "/api/trainings",
        "GET /api/trainings/{id}": lambda: f"/api/trainings/{rng.randint(1, shape['trainings'])}",
        "GET /api/steps/{id}/rollouts": lambda: (
            f"/api/steps/{rng.randint(1, shape['steps'])}/rollouts"
        ),
        "GET /api/rollouts/{id}": lambda: f"/api/rollouts/{rng.randint(1, shape['rollouts'])}",
        "GET /api/status-history/rollout/{id}": lambda: (
            f"/api/status-history/rollout/{rng.randint(1, shape['rollouts'])}"
        ),
    }
    out = []
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        for name, path in endpoints.items():
            for _ in range(5):  # warm the connection and the page cache
                (await http.get(path())).raise_for_status()
            lat = []
            for _ in range(samples):
                t0 = time.perf_counter()
                resp = await http.get(path())
                lat.append((time.perf_counter() - t0) * 1000)
                resp.raise_for_status()
            out.append((name, pct(lat, 0.5), pct(lat, 0.95)))
    return out


async def bench_pages(url: str, shape: dict, samples: int) -> list[tuple[str, float, float]]:
    """Server-side render time of each dashboard page (``Server-Timing: render;dur=<ms>``)."""
    rng = random.Random(1)
    pages = {
        "/ (trainings)": lambda: "/",
        "/trainings/{id} (100 steps)": lambda: f"/trainings/{rng.randint(1, shape['trainings'])}",
        "/steps/{id} (100-rollout grid)": lambda: f"/steps/{rng.randint(1, shape['steps'])}",
        "/rollouts/{id} (10 turns)": lambda: f"/rollouts/{rng.randint(1, shape['rollouts'])}",
    }
    out = []
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        for name, path in pages.items():
            for _ in range(3):  # templates compile on first use
                (await http.get(path())).raise_for_status()
            times = []
            for _ in range(samples):
                resp = await http.get(path())
                resp.raise_for_status()
                timing = resp.headers["server-timing"]  # render;dur=12.34
                times.append(float(timing.split("dur=")[1]))
            out.append((name, pct(times, 0.5), pct(times, 0.95)))
    return out


def screen_images(turns: int, width: int, height: int) -> list[bytes]:
    """PNG screens of the local gym's phone, one per turn of random episodes."""
    from cua_rl.sim.phone import Phone
    from cua_rl.sim.phone_render import render_png
    from cua_rl.sim.phone_tasks import TASKS, initial_state

    rng = random.Random(2)
    shots: list[bytes] = []
    while len(shots) < turns:
        task = rng.choice(TASKS)
        phone = Phone(initial_state(task, rng.randint(0, 1000)), width, height)
        for _ in range(rng.randint(2, 8)):
            shots.append(render_png(phone))
            x, y = rng.randrange(width), rng.randrange(height)
            try:
                phone.act(rng.choice(["tap", "tap", "tap", "back", "home"]), {"x": x, "y": y})
            except ValueError:
                pass
            if len(shots) >= turns:
                break
    return shots


async def bench_screenshots(url: str, db: Path, turns: int) -> None:
    from cua_rl.monitor.worker.uploader import prepare_screenshot

    cfg = MonitorClientConfig(base_url=url, token=TOKEN, spool_path=str(db.with_suffix(".spool")))
    for width, height in ((360, 640), (1080, 2400)):
        pngs = screen_images(turns, width, height)
        t0 = time.perf_counter()
        shots = [prepare_screenshot(p) for p in pngs]
        prep_ms = (time.perf_counter() - t0) * 1000 / len(pngs)
        before = _store_bytes(db)
        async with MonitorClient(cfg) as client:
            for shot in shots:
                client.put_screenshot(shot)
            await client.flush(timeout=300)
            c = client.screenshots.counters
        stored = _store_bytes(db) - before
        src = sum(len(p) for p in pngs) / len(pngs)
        enc = sum(len(s.data) for s in shots) / len(shots)
        print(
            f"  {width}x{height} -> {shots[0].width}x{shots[0].height} WebP, {len(pngs)} turns: "
            f"source PNG {src / 1024:,.1f} KiB/turn, encoded {enc / 1024:,.1f} KiB/turn "
            f"({enc / src:.0%} of the PNG), stored {stored / len(pngs) / 1024:,.1f} KiB/turn after "
            f"de-duplication ({len({s.sha256 for s in shots})} distinct images; uploaded "
            f"{c.uploaded}, skipped {c.skipped}, dropped {c.dropped}); prepare {prep_ms:.1f} ms/turn"
        )


def _store_bytes(db: Path) -> int:
    from cua_rl.monitor.server.read import MonitorReader

    read = MonitorReader(db)
    try:
        return read.screenshot_totals()["bytes"]
    finally:
        read.close()


def print_latencies(title: str, rows: list[tuple[str, float, float]], goal_ms: float) -> None:
    print(title)
    for name, p50, p95 in rows:
        verdict = "met" if p95 < goal_ms else "NOT met"
        print(
            f"  {name:40s} p50 {p50:7.2f} ms   p95 {p95:7.2f} ms   "
            f"(goal p95 < {goal_ms:.0f} ms: {verdict})"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--turns", type=int, default=1_000_000, help="turns in the read-bench db")
    ap.add_argument("--ingest-turns", type=int, default=50_000, help="turns posted over HTTP")
    ap.add_argument("--batch-turns", type=int, default=1000, help="turns per ingest batch")
    ap.add_argument("--samples", type=int, default=200, help="requests per read endpoint")
    ap.add_argument("--shot-turns", type=int, default=300, help="turns of screenshots uploaded")
    ap.add_argument(
        "--only",
        default="ingest,reads,pages,shots",
        help="comma-separated parts to run: ingest, reads, pages, shots",
    )
    ap.add_argument("--workdir", default=None, help="where the databases go (default: temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the databases")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="monitor-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    parts = set(args.only.split(","))
    try:
        if "ingest" in parts:
            with Server(work / "ingest.db") as server:
                asyncio.run(
                    bench_http_ingest(
                        server.url, server.proc.pid, args.ingest_turns, args.batch_turns
                    )
                )
                asyncio.run(
                    bench_client_ingest(server.url, args.ingest_turns, work / "spool.jsonl")
                )
        if parts & {"reads", "pages"}:
            big = work / "big.db"
            t0 = time.perf_counter()
            shape = build_big_db(big, args.turns)
            size_mb = big.stat().st_size / 1e6
            print(
                f"built read db: {shape} (+1 action, 1 observation, 1 stored screenshot per "
                f"turn) in {time.perf_counter() - t0:.1f} s, {size_mb:,.0f} MB"
            )
            with Server(big) as server:
                n = f"over {args.samples} requests each, {args.turns:,} turns"
                if "reads" in parts:
                    rows = asyncio.run(bench_reads(server.url, shape, args.samples))
                    print_latencies(f"read latency {n}:", rows, goal_ms=100)
                if "pages" in parts:
                    rows = asyncio.run(bench_pages(server.url, shape, args.samples))
                    print_latencies(f"dashboard page render time (server side) {n}:", rows, 200)
        if "shots" in parts:
            print(
                f"screenshot storage per turn ({args.shot_turns} turns of the local gym's phone):"
            )
            with Server(work / "shots.db") as server:
                asyncio.run(bench_screenshots(server.url, work / "shots.db", args.shot_turns))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
