"""The rollout gateway under load: many concurrent episodes against a stand-in model server.

Three processes, so each one's CPU is its own: a stand-in model server (``ModelStandIn``, a fixed
latency per generation, plus the screenshots at http URLs), the gateway (one per rollout worker in
production; here with the tiny BPE Qwen2-VL's processor, ``gconfig.max_tokens`` set, so each new
screenshot is measured once for its pads), and this process as the agents. Each of ``--episodes``
episodes runs ``--turns`` turns at once with the others: a system prompt, a user turn with a new
screenshot per step, the whole history re-sent each turn with every screenshot URL re-signed (as a
presigned S3 URL is), the reply appended as returned.

Printed: the latency of a call through the gateway and of the same number of calls straight to
the stand-in at the same concurrency (p50, p99; "added" is the difference), the gateway's CPU
seconds per call (its process's user + system time over the load), its memory per episode (RSS
growth with every episode open and its turns captured, over the episode count), screenshot
fetches against distinct screenshots, and errors (any non-200 answer or transport error).

    .venv/bin/python bench/gateway_load.py [--episodes 256 --turns 10 --latency 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def screenshot(episode: int, turn: int) -> bytes:
    from PIL import Image

    noise = random.Random(episode * 1000 + turn).randbytes(128 * 96 * 3)
    img = Image.frombytes("RGB", (128, 96), noise)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def serve_standin(latency: float) -> None:
    from fastapi import Response

    from cua_rl.serving import ThreadedServer
    from cua_rl.testing.model_standin import ModelStandIn

    standin = ModelStandIn(output_ids=tuple(range(40, 56)), latency_s=latency)
    shots: dict[tuple[int, int], bytes] = {}

    @standin.app.get("/shots/{episode}/{turn}.png")
    def shot(episode: int, turn: int):
        key = (episode, turn)
        if key not in shots:
            shots[key] = screenshot(episode, turn)
        return Response(shots[key], media_type="image/png")

    with ThreadedServer(standin.app, name="standin") as server:
        print(json.dumps({"url": server.url}), flush=True)
        sys.stdin.readline()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def serve_gateway(standin: str, episodes: int) -> None:
    from transformers import AutoProcessor

    from cua_rl.gateway import Gateway, GatewayConfig, Sampling, SessionSpec
    from cua_rl.testing.cache import ensure_model
    from cua_rl.testing.model_standin import StaticEngine
    from cua_rl.trajectory.config import TrajectoryConfig

    processor = AutoProcessor.from_pretrained(ensure_model("qwen2-vl-bpe"))
    gw = Gateway(GatewayConfig(max_connections=episodes)).start()
    images = TrajectoryConfig(allow_http=True, allowed_image_hosts=("127.0.0.1",))
    sampling = Sampling(max_new_tokens=16, max_tokens=32768)
    spec = SessionSpec(
        StaticEngine(standin.removeprefix("http://")), sampling, processor, "p", images
    )
    before = rss_bytes()
    start = os.times()
    urls = [gw.open(f"ep{i}", spec) for i in range(episodes)]
    print(json.dumps({"urls": urls}), flush=True)
    sys.stdin.readline()  # the load is over
    held = rss_bytes()
    stats = [gw.close(f"ep{i}").stats() for i in range(episodes)]
    total = {k: sum(s[k] for s in stats) for k in stats[0]}
    end = os.times()
    cpu = end.user + end.system - start.user - start.system
    print(json.dumps({"rss_growth": held - before, "stats": total, "cpu": cpu}))
    gw.stop()


def user(text: str, url: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}, _image(url)]}


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def signed(base: str, episode: int, turn: int, now: int) -> str:
    return f"{base}/shots/{episode}/{turn}.png?X-Amz-Expires=900&X-Amz-Signature=t{now}"


async def agent(http, url: str, standin: str, episode: int, turns: int, out: dict) -> None:
    messages: list[dict] = [{"role": "system", "content": "You operate a phone."}]
    for turn in range(turns):
        # Re-sign every screenshot of the history, then add this turn's.
        for n, msg in enumerate(m for m in messages if m["role"] == "user"):
            msg["content"][1] = _image(signed(standin, episode, n, turn))
        messages.append(user(f"Step {turn}", signed(standin, episode, turn, turn)))
        t0 = time.perf_counter()
        try:
            r = await http.post(f"{url}/chat/completions", json={"messages": messages})
        except httpx.HTTPError as exc:
            out["errors"].append(repr(exc))
            return
        out["latency"].append(time.perf_counter() - t0)
        if r.status_code != 200:
            out["errors"].append(r.text[:200])
            return
        messages.append(r.json()["choices"][0]["message"])


async def direct(http, standin: str, calls: int, out: dict) -> None:
    body = {"token_ids": list(range(1, 200)), "sampling_params": {"max_tokens": 16}}
    for _ in range(calls):
        t0 = time.perf_counter()
        r = await http.post(f"{standin}/inference/v1/generate", json=body)
        out["latency"].append(time.perf_counter() - t0)
        if r.status_code != 200:
            out["errors"].append(r.text[:200])


def child(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


async def load(args) -> None:
    standin_proc = child("--role", "standin", "--latency", str(args.latency))
    standin = json.loads(standin_proc.stdout.readline())["url"]
    gateway_proc = child(
        "--role", "gateway", "--standin", standin, "--episodes", str(args.episodes)
    )
    urls = json.loads(gateway_proc.stdout.readline())["urls"]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.episodes)
    via = {"latency": [], "errors": []}
    straight = {"latency": [], "errors": []}
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(direct(http, standin, args.turns, straight) for _ in urls))
        t0 = time.perf_counter()
        await asyncio.gather(
            *(agent(http, u, standin, i, args.turns, via) for i, u in enumerate(urls))
        )
        wall = time.perf_counter() - t0
    gateway_proc.stdin.write("done\n")
    gateway_proc.stdin.flush()
    report = json.loads(gateway_proc.stdout.readline())
    gateway_proc.wait()
    standin_proc.stdin.write("done\n")
    standin_proc.stdin.flush()
    standin_proc.wait()
    calls = len(via["latency"])
    p = {k: _percentile(via["latency"], q) for k, q in (("p50", 0.5), ("p99", 0.99))}
    d = {k: _percentile(straight["latency"], q) for k, q in (("p50", 0.5), ("p99", 0.99))}
    stats = report["stats"]
    print(f"{args.episodes} episodes x {args.turns} turns, stand-in latency {args.latency} s")
    print(f"calls answered        {calls} in {wall:.1f} s ({calls / wall:.0f}/s)")
    for k in ("p50", "p99"):
        added = p[k] - d[k]
        print(
            f"latency {k}           gateway {p[k]:.3f} s, direct {d[k]:.3f} s, added {added:.3f} s"
        )
    print(
        f"gateway CPU per call  {1000 * report['cpu'] / max(calls, 1):.1f} ms (gateway process, over the load)"
    )
    mib = report["rss_growth"] / args.episodes / 2**20
    print(f"memory per episode    {mib:.2f} MiB (gateway RSS growth / episodes)")
    fetched = int(stats["gateway/image_fetches"])
    print(f"screenshot fetches    {fetched} for {args.episodes * args.turns} distinct screenshots")
    print(
        f"errors                {len(via['errors']) + len(straight['errors'])} "
        f"(gateway-side {int(stats['gateway/errors'])})"
    )
    for err in (via["errors"] + straight["errors"])[:3]:
        print("  ", err)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--latency", type=float, default=0.2, help="stand-in seconds per generation")
    ap.add_argument("--role", choices=("load", "standin", "gateway"), default="load")
    ap.add_argument("--standin", default="")
    args = ap.parse_args()
    if args.role == "standin":
        serve_standin(args.latency)
    elif args.role == "gateway":
        serve_gateway(args.standin, args.episodes)
    else:
        asyncio.run(load(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
