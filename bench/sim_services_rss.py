"""The local gym's and the local agent's anonymous memory over many episodes.

Both services keep what a finished episode left for later reads: the gym each terminated
execution's screenshots (fetchable for an hour), the agent each finished run's record (its last
512 runs). This bench starts both from their command lines (``python -m cua_rl.sim gym|agent``,
their defaults, as ``bench/soak.py`` does), a scripted chat model in this process
(``cua_rl.testing.chat_model``: a growing prompt, 2 to 6 steps per episode), and runs
``--episodes`` episodes ``--concurrency`` at a time: create an execution, drive an agent run
on it to its end, terminate it. Printed per service: anonymous MiB (``RssAnon``) after
``--warm`` episodes and at the end, their ratio, and what its ``/healthz`` reports keeping.

``--code DIR`` runs the services from another checkout (its ``cua_rl``), for a before/after.

    python bench/sim_services_rss.py [--episodes 600] [--concurrency 4] [--code DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from soak import rss_split  # noqa: E402 - beside this file

from cua_rl.agent.service_driver import DriverConfig, drive_run  # noqa: E402
from cua_rl.agent.spec import RunSpec  # noqa: E402
from cua_rl.clients.genv import GenvClient  # noqa: E402
from cua_rl.testing.chat_model import ScriptedChatModel  # noqa: E402

TASK = "sim-001-wifi-on"
STEPS = ("tap(300, 116)", "tap(70, 130)", "back()", "tap(300, 116)", "home()")


def start(service: str, code: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(code), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cua_rl.sim", service, "--port", "0"],
        cwd=code,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    line = proc.stdout.readline().strip()
    if not line.startswith("ready "):
        proc.kill()
        raise RuntimeError(f"{service} did not start: {line!r}")
    url = line.split(" ", 1)[1]
    return proc, url.split("/api/v1/")[0]


async def episode(gym: GenvClient, agent_url: str, gym_url: str, model_url: str, steps: int):
    created = await gym.create_execution(TASK)
    try:
        spec = RunSpec(
            task="Turn Wi-Fi on.", model_base_url=model_url, model_name="scripted",
            gym_base_url=gym_url, gym_id="sim", execution_id=created.execution_id,
            max_steps=steps,
        )  # fmt: skip
        await drive_run(agent_url, spec, config=DriverConfig(deadline_s=120))
    finally:
        await gym.terminate(created.execution_id)


def anon_mib(proc: subprocess.Popen) -> float:
    return rss_split(proc.pid)[0] / 2**20


async def run(args, gym_url: str, agent_url: str, model_url: str, procs: dict) -> dict:
    rng = random.Random(args.seed)
    warm: dict[str, float] = {}
    sem = asyncio.Semaphore(args.concurrency)
    done = 0

    async with GenvClient(gym_url, "sim") as gym:

        async def one(i: int) -> None:
            nonlocal done
            async with sem:
                await episode(gym, agent_url, gym_url, model_url, rng.randint(2, 6))
            done += 1
            if done == args.warm:
                warm.update({name: anon_mib(p) for name, p in procs.items()})

        await asyncio.gather(*(one(i) for i in range(args.episodes)))
    end = {name: anon_mib(p) for name, p in procs.items()}
    async with httpx.AsyncClient(timeout=10) as http:
        health = {
            "gym": (await http.get(f"{gym_url}/healthz")).json(),
            "agent": (await http.get(f"{agent_url}/healthz")).json(),
        }
    return {"warm": warm, "end": end, "health": health}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=600)
    ap.add_argument("--warm", type=int, default=50, help="episodes before the 'warm' figure")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout the services run from")
    args = ap.parse_args()
    if not 0 < args.warm < args.episodes:
        ap.error("0 < --warm < --episodes")
    replies = (*STEPS, 'finished("done")')
    model = ScriptedChatModel(replies, prompt_ids_per_call=1500, episode_len=len(replies))
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["gym"], gym_url = start("gym", args.code.resolve())
        procs["agent"], agent_url = start("agent", args.code.resolve())
        with model.server:
            r = asyncio.run(run(args, gym_url, agent_url, f"{model.server.url}/v1", procs))
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(timeout=30)
    print(f"{args.episodes} episodes, {args.concurrency} at a time; anonymous MiB")
    print(f"{'service':<6} {'warm':>6} {'end':>6} {'x':>5}  keeps")
    keeps = {
        "gym": lambda h: h.get("screenshots", "(no screenshots figure)"),
        "agent": lambda h: {k: v for k, v in h.items() if k != "ok"},
    }
    for name in procs:
        w, e = r["warm"][name], r["end"][name]
        print(f"{name:<6} {w:>6.1f} {e:>6.1f} {e / w:>5.2f}  {keeps[name](r['health'][name])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
