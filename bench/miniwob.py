"""The browser gym (MiniWoB++ in headless chromium) against the simulated phone, same settings.

For each backend it starts the local gym in this process (a loopback port) and measures over
HTTP, as the local agent calls it:

- execution create time (``POST /tasks/{id}``; the browser opens a context and loads the page);
- screenshot round trip (``POST .../screenshot``: capture, PNG, base64 data URL) and action
  round trip (``POST .../actions``, a tap);
- episodes per minute with ``--concurrency`` pages at once (8 by default), an episode being
  create, ``--steps`` x (screenshot + tap), evaluate, terminate: the environment's share of an
  agent episode, no model;
- memory per open execution: for the browser the proportional set size (PSS) of the gym's
  chromium processes with ``--concurrency`` executions open, less that with none, per
  execution; for the phone the gym process's RSS growth per execution.

It prints each figure per backend and the browser / phone ratio.

    python bench/miniwob.py [--concurrency 8] [--steps 3] [--duration 30] [--samples 20]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import time
from pathlib import Path

import httpx

from cua_rl.sim.gym import GymServer, SimGymConfig
from cua_rl.testing.procs import chromium_processes, pss_bytes

TASKS = {"phone": "sim-001-wifi-on", "browser": "miniwob-click-test"}
TAP = {"name": "tap", "args": {"x": 10, "y": 300}}  # blank on both screens: no episode end


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def rss_bytes() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1)) << 10


class Bench:
    def __init__(self, gym: GymServer, http: httpx.AsyncClient, backend: str):
        self.gym, self.http, self.backend = gym, http, backend
        self.base = gym.base_url

    async def create(self) -> str:
        r = await self.http.post(f"{self.base}/tasks/{TASKS[self.backend]}", json={})
        r.raise_for_status()
        return r.json()["execution_id"]

    async def call(self, eid: str, what: str, body: dict | None = None) -> None:
        r = await self.http.post(f"{self.base}/executions/{eid}/{what}", json=body)
        r.raise_for_status()

    async def timed(self, coro) -> float:
        t0 = time.perf_counter()
        await coro
        return (time.perf_counter() - t0) * 1000

    async def latencies(self, samples: int) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"create": [], "screenshot": [], "action": []}
        for _ in range(samples // 4 or 1):
            t0 = time.perf_counter()
            eid = await self.create()
            out["create"].append((time.perf_counter() - t0) * 1000)
            await self.call(eid, "terminate")
        eid = await self.create()
        for _ in range(samples):
            out["screenshot"].append(await self.timed(self.call(eid, "screenshot")))
            out["action"].append(await self.timed(self.call(eid, "actions", TAP)))
        await self.call(eid, "terminate")
        return out

    async def episode(self, steps: int) -> None:
        eid = await self.create()
        try:
            for _ in range(steps):
                await self.call(eid, "screenshot")
                await self.call(eid, "actions", TAP)
            await self.call(eid, "evaluate", {})
        finally:
            await self.call(eid, "terminate")

    async def throughput(self, concurrency: int, steps: int, duration: float) -> float:
        stop_at = time.monotonic() + duration
        done = 0

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                await self.episode(steps)
                done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.monotonic() - t0) * 60

    def memory(self) -> int:
        if self.backend == "browser":
            return pss_bytes(chromium_processes(self.gym.gym.backend.browser_pid))
        return rss_bytes()

    async def memory_per_execution(self, concurrency: int) -> float:
        await asyncio.sleep(1.0)  # let the browser reap what earlier phases closed
        before = self.memory()
        ids = await asyncio.gather(*(self.create() for _ in range(concurrency)))
        for eid in ids:
            await self.call(eid, "screenshot")
        after = self.memory()
        for eid in ids:
            await self.call(eid, "terminate")
        return (after - before) / concurrency


async def run_backend(backend: str, args) -> dict[str, float]:
    cfg = SimGymConfig(gym_id=backend, backend=backend)
    with GymServer(cfg) as gym:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            b = Bench(gym, http, backend)
            await b.episode(1)  # warm up imports and first-render paths
            lat = await b.latencies(args.samples)
            epm = await b.throughput(args.concurrency, args.steps, args.duration)
            mem = await b.memory_per_execution(args.concurrency)
    figures = {f"{k}_ms_p50": statistics.median(v) for k, v in lat.items()}
    figures |= {f"{k}_ms_p95": pct(v, 0.95) for k, v in lat.items()}
    figures["episodes_per_min"] = epm
    figures["mib_per_execution"] = mem / (1 << 20)
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--samples", type=int, default=20)
    args = p.parse_args()
    results = {b: asyncio.run(run_backend(b, args)) for b in ("phone", "browser")}
    print(
        f"{args.concurrency} concurrent, {args.steps} steps per episode, {args.duration:g}s "
        "of episodes per backend"
    )
    print(f"{'figure':24} {'phone':>10} {'browser':>10} {'browser/phone':>14}")
    for key in results["phone"]:
        ph, br = results["phone"][key], results["browser"][key]
        ratio = br / ph if ph else float("nan")
        print(f"{key:24} {ph:10.2f} {br:10.2f} {ratio:14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
