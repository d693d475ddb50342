"""What ``cua_rl.heap`` (glibc's mmap threshold held, ``malloc_trim``) saves a rollout worker.

The rollout worker processes each episode's screenshots with the model's processor in pool
threads (``asyncio.to_thread``), 4 episodes at a time as in ``configs/local.yaml``. Each
measurement runs in a fresh child process: the tiny Qwen2-VL's processor on 2 to 6 random
screenshots (320 to 640 x 240 to 480) per episode, ``--episodes`` episodes: ``plain``, ``trim``
(a trim after each episode) and ``held`` (the threshold held from the start, and the trim).
Printed per case: RSS after warm-up (the first 50 episodes) and at the end,
their ratio (the growth this soak-like load leaves), Python's own heap (tracemalloc) at the end,
and the trim's time per call.

    python bench/heap_trim.py [--episodes 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARM = 50
CASES = ("plain", "trim", "held")


def child(episodes: int, case: str) -> dict:
    from cua_rl.heap import hold_mmap_threshold, release_free_memory

    if case == "held":
        hold_mmap_threshold()  # before the libraries below allocate, as a worker does
    import tracemalloc

    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    from cua_rl.testing.cache import ensure_model
    from cua_rl.testing.memory import rss_bytes

    trim = case != "plain"
    processor = AutoProcessor.from_pretrained(str(ensure_model("qwen2-vl-bpe")))
    trim_s: list[float] = []

    def episode(seed: int) -> None:
        r = random.Random(seed)
        rng = np.random.default_rng(seed)
        shape = lambda: (r.choice([320, 480, 640]), r.choice([240, 360, 480]), 3)  # noqa: E731
        images = [
            Image.fromarray(rng.integers(0, 255, shape(), dtype=np.uint8))
            for _ in range(r.randint(2, 6))
        ]
        text = "<|vision_start|><|image_pad|><|vision_end|>x " * len(images)
        out = processor(text=[text], images=images, return_tensors="pt")
        del out
        if trim:
            t0 = time.perf_counter()
            release_free_memory()
            trim_s.append(time.perf_counter() - t0)

    async def run() -> dict:
        tracemalloc.start()
        warm = None
        for i in range(0, episodes, 4):
            await asyncio.gather(*(asyncio.to_thread(episode, i + k) for k in range(4)))
            if warm is None and i + 4 >= WARM:
                warm = rss_bytes() / 2**20
        return {
            "warm": warm,
            "end": rss_bytes() / 2**20,
            "python_heap": tracemalloc.get_traced_memory()[0] / 2**20,
            "trim_ms": 1000 * sum(trim_s) / len(trim_s) if trim_s else None,
        }

    return asyncio.run(run())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=400)
    ap.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.episodes, args.child)))
        return 0
    print(
        f"{'case':<6} {'RSS warm MiB':>12} {'end':>6} {'x':>5} {'python heap':>11} {'trim ms':>8}"
    )
    for case in CASES:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", case, "--episodes", str(args.episodes)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        trim = f"{r['trim_ms']:.2f}" if r["trim_ms"] is not None else "-"
        print(
            f"{case:<6} {r['warm']:>12.0f} {r['end']:>6.0f} {r['end'] / r['warm']:>5.2f} "
            f"{r['python_heap']:>11.1f} {trim:>8}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
