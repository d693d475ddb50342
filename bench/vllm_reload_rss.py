"""The vLLM CPU server's anonymous memory over weight reloads, per environment variant.

The training's model server reloads the whole checkpoint from disk after every step (AReaL's
disk mode, ``POST /areal_update_weights``), and in a 60-minute soak its anonymous memory rose
2479 -> 3000 MiB, steeply at first, then levelling off (docs/soak.md). This bench starts the
server as the rollout worker does (``cua_rl.inference.vllm_server`` with AReaL's arguments and the
worker's environment, the tiny Qwen2-VL of ``configs/local.yaml``), then repeats ``--rounds``
times: ``--requests`` concurrent chat completions of varied length with 0 to 4 screenshots
(360x640, as the local gym's), and a reload from a freshly written checkpoint folder
(``weight_update_v<N>``, the previous one removed, as AReaL does). After each reload it reads
the anonymous RSS of the server's processes (``RssAnon`` of the process tree).

Variants (the server's environment on top of the worker's):
- ``base``: as the training starts it.
- ``arenas``: ``MALLOC_ARENA_MAX=2`` (glibc's per-thread arenas; the engine has many threads).
- ``mmap``: ``MALLOC_MMAP_THRESHOLD_=131072``: the threshold held in every process from its
  start (the worker extension holds it only in the engine core, once imported).
- ``onednn``: ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``: no per-shape oneDNN kernel cache.
- ``onednn+mmap``, ``onednn+arenas``, ``all``: together; ``onednn64+mmap``: a cache of 64.

Printed per variant: anonymous MiB after ``--warm`` rounds, at the end, end over warm, the
median seconds of a round's requests (what a variant costs in speed) and the samples every
``--every`` rounds. Each variant starts its own server (minutes on a small
machine); run it under the shared heavy lock.

    python bench/vllm_reload_rss.py [--variants base,mmap] [--rounds 60] [--requests 8]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from soak import rss_split  # noqa: E402 - beside this file

from cua_rl.cpu.training import WORKER_EXTENSION  # noqa: E402
from cua_rl.testing.cache import ensure_model  # noqa: E402
from cua_rl.testing.vllm_server import VLLMServer  # noqa: E402

VARIANTS = {
    "base": {},
    "arenas": {"MALLOC_ARENA_MAX": "2"},
    "mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    "onednn": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"},
    "onednn+mmap": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "MALLOC_MMAP_THRESHOLD_": "131072"},
    "onednn+arenas": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "MALLOC_ARENA_MAX": "2"},
    "onednn64+mmap": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "MALLOC_MMAP_THRESHOLD_": "131072"},
    "all": {
        "MALLOC_ARENA_MAX": "2",
        "MALLOC_MMAP_THRESHOLD_": "131072",
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
    },
}

# What AReaL's rollout worker passes on top of VLLMServer's own arguments (its launch line in a
# soak's rollout.log), the later ones winning over VLLMServer's defaults.
AREAL_ARGS = [
    "--load-format", "auto", "--trust-remote-code", "--tensor-parallel-size", "1",
    "--pipeline-parallel-size", "1", "--seed", "1", "--distributed-executor-backend", "mp",
    "--max-num-seqs", "256", "--block-size", "32", "--cpu-offload-gb", "0.0",
    "--disable-sliding-window", "--no-enable-prefix-caching",
    "--gpu-memory-utilization", "0.9", "--worker-extension-cls", WORKER_EXTENSION,
    "--max-lora-rank", "16", "--max-loras", "8",
]  # fmt: skip


def screenshot(rng: random.Random) -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (360, 640), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x, y = rng.randrange(340), rng.randrange(620)
        draw.rectangle((x, y, x + rng.randrange(8, 120), y + rng.randrange(8, 60)), fill=(
            rng.randrange(256), rng.randrange(256), rng.randrange(256)))  # fmt: skip
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def request(rng: random.Random, model: str) -> dict:
    content: list[dict] = [
        {"type": "image_url", "image_url": {"url": screenshot(rng)}}
        for _ in range(rng.randint(0, 4))
    ]
    words = " ".join(rng.choice(("tap", "the", "Wi-Fi", "switch", "open", "settings"))
                     for _ in range(rng.randint(5, 400)))  # fmt: skip
    content.append({"type": "text", "text": words})
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": rng.randint(4, 48),
        "temperature": 1.0,
    }


def anon_mib(root: int) -> float:
    procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += rss_split(p.pid)[0]
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone between listing and reading
    return total / 2**20


async def one_round(http: httpx.AsyncClient, server: VLLMServer, rng, n: int, ckpt: Path) -> float:
    """Seconds the requests took; then the reload."""
    t0 = time.monotonic()
    answers = await asyncio.gather(
        *(http.post(f"{server.base_url}/chat/completions", json=request(rng, server.model))
          for _ in range(n))
    )  # fmt: skip
    for r in answers:
        r.raise_for_status()
    took = time.monotonic() - t0
    r = await http.post(
        f"http://{server.host}:{server.port}/areal_update_weights",
        json={"model_path": str(ckpt)},
    )
    if r.status_code != 200 or not r.json().get("success"):
        raise RuntimeError(f"reload from {ckpt} failed: {r.status_code} {r.text[:300]}")
    return took


def measure(variant: str, args, model_dir: Path, work: Path) -> tuple[list[float], float]:
    env = {"OMP_NUM_THREADS": "1", **VARIANTS[variant]}
    server = VLLMServer(
        model_dir,
        model="tiny",
        extra_args=AREAL_ARGS,
        env=env,
        log_path=work / f"vllm-{variant}.log",
    )
    rng = random.Random(args.seed)
    samples: list[float] = []
    seconds: list[float] = []
    with server:
        root = server.process.pid

        async def run() -> None:
            async with httpx.AsyncClient(timeout=300) as http:
                previous: Path | None = None
                for i in range(args.rounds):
                    ckpt = work / f"weight_update_v{i + 1}"
                    shutil.copytree(model_dir, ckpt)
                    seconds.append(await one_round(http, server, rng, args.requests, ckpt))
                    if previous is not None:
                        shutil.rmtree(previous)
                    previous = ckpt
                    samples.append(anon_mib(root))

        asyncio.run(run())
    return samples, statistics.median(seconds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--warm", type=int, default=10, help="rounds before the 'warm' figure")
    ap.add_argument("--requests", type=int, default=8, help="concurrent requests per round")
    ap.add_argument("--every", type=int, default=10, help="print a sample every N rounds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = set(names) - set(VARIANTS)
    if unknown or not 0 < args.warm < args.rounds:
        ap.error(f"variants from {sorted(VARIANTS)}; 0 < --warm < --rounds")
    model_dir = ensure_model("qwen2-vl-bpe")
    print(f"{args.rounds} rounds of {args.requests} requests and a reload; anonymous MiB")
    print(
        f"{'variant':<13} {'warm':>6} {'end':>6} {'x':>5} {'s/round':>7}  every {args.every} rounds"
    )
    for name in names:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="vllm-reload-") as tmp:
            samples, per_round = measure(name, args, model_dir, Path(tmp))
        warm, end = samples[args.warm - 1], samples[-1]
        trace = " ".join(f"{s:.0f}" for s in samples[:: args.every])
        print(
            f"{name:<13} {warm:>6.0f} {end:>6.0f} {end / warm:>5.2f} {per_round:>7.2f}  {trace}"
            f"  ({time.monotonic() - t0:.0f}s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
