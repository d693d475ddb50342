"""Round trips per second through the genv client: create -> evaluate -> terminate.

Starts the local sim gym as a subprocess on a free loopback port (or uses ``--url``), runs
``--concurrency`` workers (64 by default) for ``--duration`` seconds, and prints round trips per
second, per-call latency percentiles and the number of executions left open (must be 0).
Then it repeats the same loop with a bare aiohttp session and prints the ratio: httpx's
AsyncClient is known to scale poorly with concurrency (encode/httpx#3215), and the ratio tells
the client's overhead apart from the server's.

    python bench/gym_roundtrip.py [--concurrency 64] [--duration 10] [--url http://HOST:PORT --gym-id sim]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import httpx

from cua_rl.clients.genv import GenvClient, GenvTimeouts

TASK = "sim-001-wifi-on"


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def bench(url: str, gym_id: str, concurrency: int, duration: float) -> int:
    limits = httpx.Limits(
        max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2
    )
    lat: dict[str, list[float]] = {"create": [], "evaluate": [], "terminate": []}
    errors = 0
    async with httpx.AsyncClient(limits=limits) as http:
        client = GenvClient(
            url,
            gym_id,
            client=http,
            timeouts=GenvTimeouts(create_s=30, evaluate_s=30, terminate_s=30),
        )
        stop_at = time.monotonic() + duration
        done = 0

        async def worker() -> None:
            nonlocal done, errors
            while time.monotonic() < stop_at:
                try:
                    t0 = time.perf_counter()
                    async with client.execution(TASK) as ex:
                        t1 = time.perf_counter()
                        await ex.evaluate(answer_text="bench")
                        t2 = time.perf_counter()
                    t3 = time.perf_counter()
                except Exception as e:  # counted, and the run goes on
                    errors += 1
                    print(f"error: {e}", file=sys.stderr)
                    continue
                lat["create"].append(t1 - t0)
                lat["evaluate"].append(t2 - t1)
                lat["terminate"].append(t3 - t2)
                done += 1

        # One warm-up round trip per worker slot's connection is not worth the complexity;
        # a single one warms imports and the server's first render paths.
        async with client.execution(TASK) as ex:
            await ex.evaluate()
        t_start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - t_start
        await client.aclose()
        left = (await http.get(f"{client.base}/executions")).json().get("executions", [])
    print(f"concurrency            {concurrency}")
    print(f"duration_s             {elapsed:.2f}")
    print(f"round_trips            {done}")
    print(f"round_trips_per_s      {done / elapsed:.1f}")
    print(f"calls_per_s            {3 * done / elapsed:.1f}")
    for op, xs in lat.items():
        print(f"{op:<10} ms p50/p95   {1000 * pct(xs, 0.5):.1f} / {1000 * pct(xs, 0.95):.1f}")
    print(f"errors                 {errors}")
    print(f"open_executions_after  {len(left)}")
    raw = await bench_raw(url, gym_id, concurrency, duration)
    print(f"raw_aiohttp_rt_per_s   {raw:.1f}")
    print(f"genv_over_raw_ratio    {done / elapsed / raw:.2f}")
    return 0 if errors == 0 and not left else 1


async def bench_raw(url: str, gym_id: str, concurrency: int, duration: float) -> float:
    """The same round trip with a bare aiohttp session: the server's own ceiling."""
    base = f"{url}/api/v1/{gym_id}"
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency * 2)) as s:
        stop_at = time.monotonic() + duration

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                async with s.post(f"{base}/tasks/{TASK}", json={"options": {}}) as r:
                    eid = (await r.json())["execution_id"]
                async with s.post(
                    f"{base}/executions/{eid}/evaluate", json={"answer_text": "bench"}
                ) as r:
                    await r.read()
                async with s.post(f"{base}/executions/{eid}/terminate") as r:
                    await r.read()
                done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.monotonic() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument(
        "--url", help="an already running gym (base URL without /api/v1); default: start one"
    )
    p.add_argument("--gym-id", default="sim")
    args = p.parse_args()
    if args.url:
        return asyncio.run(bench(args.url, args.gym_id, args.concurrency, args.duration))
    cmd = [
        sys.executable,
        "-m",
        "cua_rl.sim",
        "gym",
        "--port",
        "0",
        "--gym-id",
        args.gym_id,
        "--max-live",
        str(max(256, 2 * args.concurrency)),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline().strip() if proc.stdout else ""
        if not line.startswith("ready "):
            print(f"the sim gym did not start (got {line!r})", file=sys.stderr)
            return 2
        base = line.split()[1].rsplit("/api/v1/", 1)[0]
        print(f"gym                    {base} (subprocess)")
        return asyncio.run(bench(base, args.gym_id, args.concurrency, args.duration))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


if __name__ == "__main__":
    sys.exit(main())
