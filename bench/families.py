"""What a phone screenshot costs per model family and pixel budget, and what a long row costs.

For Qwen2.5-VL and Qwen3-VL (Qwen3-VL-MoE has Qwen3-VL's processor), each with its released
processor's default pixel budget and the budget docs/families.md recommends, at phone size
(a 1080x2400 screenshot rendered by the sim phone):

- image tokens per screenshot (the family's own processor: patch 14 or 16, merge 2);
- for episodes of 10, 30 and 50 turns (one screenshot per turn, append-only history, as the
  agent sends it): conversion time per turn, the merged row's length, and the converter's peak
  memory (RSS above the child process's baseline; each case runs in a fresh child process).

The tiny models' processors are the released classes with the budget set here, so the token
counts are those of the released checkpoints. CPU only; the episode synthesiser is
bench/trajectory_convert.py's.

    python bench/families.py [--turns 10 30 50] [--families qwen2.5-vl qwen3-vl]
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHONE = (1080, 2400)
# (min_pixels, max_pixels): the released processors' defaults, and the recommended budget
# (about a megapixel: 1280 merged tokens of 28x28 or 1024 of 32x32 pixels at most).
BUDGETS = {
    "qwen2.5-vl": {"default": (3136, 12845056), "recommended": (3136, 1280 * 28 * 28)},
    "qwen3-vl": {"default": (65536, 16777216), "recommended": (65536, 1024 * 32 * 32)},
}
MIB = 1 << 20


def processor_with(family: str, budget: tuple[int, int]):
    from transformers import AutoProcessor

    from cua_rl.testing.cache import ensure_model

    proc = AutoProcessor.from_pretrained(ensure_model(family))
    lo, hi = budget
    improc = proc.image_processor
    improc.min_pixels, improc.max_pixels = lo, hi
    improc.size = {"shortest_edge": lo, "longest_edge": hi}
    return proc


def tokens_per_screenshot(proc) -> tuple[int, list[int]]:
    from PIL import Image

    from cua_rl.sim.phone import TASKS, Phone, initial_state

    png = Phone(initial_state(TASKS[0], 0), *PHONE).render_png()
    img = Image.open(io.BytesIO(png)).convert("RGB")
    grid = proc.image_processor(images=[img], return_tensors="pt")["image_grid_thw"][0]
    return int(grid.prod()) // proc.image_processor.merge_size**2, [int(g) for g in grid]


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _child(family: str, budget: tuple[int, int], log_path: str, conn) -> None:
    import torch

    from cua_rl.trajectory import convert_turns, events_to_turns

    torch.set_num_threads(1)
    proc = processor_with(family, budget)
    events = json.loads(Path(log_path).read_text())
    convert_turns(events_to_turns(events[:5]).turns, processor=proc, reward=0.0, version=0)
    base = _rss_mib()
    t0 = time.perf_counter()
    parsed = events_to_turns(events)
    result = convert_turns(parsed.turns, processor=proc, reward=1.0, version=0)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row = result.row
    conn.send(
        {
            "ok": result.ok,
            "reason": result.reason,
            "turns": len(parsed.turns),
            "seconds": seconds,
            "row_len": int(row["input_ids"].shape[1]) if row else 0,
            "pixel_mib": row["multi_modal_input"][0]["pixel_values"].numel() * 4 / MIB
            if row
            else 0,
            "peak_above_base_mib": peak - base,
        }
    )


def measure_row(family: str, budget: tuple[int, int], turns: int) -> dict:
    from trajectory_convert import synthesise

    from cua_rl.testing.cache import ensure_model

    proc = processor_with(family, budget)
    events = synthesise(str(ensure_model(family)), turns, processor=proc, size=PHONE)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "events.json"
        log.write_text(json.dumps(events))
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_child, args=(family, budget, str(log), child))
        p.start()
        r = parent.recv()
        p.join(timeout=120)
    return r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[10, 30, 50])
    parser.add_argument("--families", nargs="+", default=list(BUDGETS), choices=list(BUDGETS))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    print(f"screenshot {PHONE[0]}x{PHONE[1]} (sim phone); CPU only")
    header = "family       budget       max_pixels  tokens/shot (grid t,h,w)"
    print(header)
    cases = []
    for family in args.families:
        for name, budget in BUDGETS[family].items():
            n, grid = tokens_per_screenshot(processor_with(family, budget))
            print(f"{family:<12} {name:<12} {budget[1]:>10}  {n:>5} {tuple(grid)}")
            cases.append((family, name, budget, n))
    print()
    print("family       budget       turns  row tokens  ms/turn  pixel MiB  peak MiB (above base)")
    for family, name, budget, _ in cases:
        for turns in args.turns:
            r = measure_row(family, budget, turns)
            if not r["ok"]:
                print(f"{family:<12} {name:<12} {turns:>5}  rejected: {r['reason']}")
                continue
            print(
                f"{family:<12} {name:<12} {turns:>5}  {r['row_len']:>10}  "
                f"{r['seconds'] / r['turns'] * 1000:>7.1f}  {r['pixel_mib']:>9.0f}  "
                f"{r['peak_above_base_mib']:>8.0f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
