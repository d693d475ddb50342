"""The project's actor against AReaL's where there is nothing to share: current-screenshot rows.

On an H200 cua-rl's actor took 1.14x AReaL's time on rows that each hold only the current
screenshot (docs/gpu.md): no screenshot repeats, so vision deduplication saves nothing and what
remains is the actor's own bookkeeping. This script finds it on a CPU: the same step (one
``compute_logp`` and one ``ppo_update`` of a GRPO group of 2 episodes of current-only rows, a
tiny model with Qwen-VL's 151,936-id vocabulary) by AReaL's ``FSDPPPOActor`` and by the
project's actor with each of its switches alone, timed in this process's CPU seconds (steadier
than wall time on a shared machine), median of ``--repeat`` steps after a warm-up; then a
profile of the project's actor and AReaL's, their operators side by side, largest difference
first.

    .venv/bin/python bench/actor_overhead.py [--turns 10] [--repeat 3] [--profile cua-dedup]

Prints one line per actor (seconds and the ratio to AReaL's) and, with ``--profile NAME``, the
operators whose CPU time differs most between NAME's step and AReaL's. Nothing is written.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _actors():
    from areal.engine.fsdp_engine import FSDPPPOActor

    from cua_rl.areal.actor import CuaPPOActor
    from cua_rl.areal.logits_engine import SelectiveLogitsPPOActor
    from cua_rl.areal.vision import VisionSection

    return {
        "areal": (FSDPPPOActor, VisionSection(dedup=False)),
        "cua": (SelectiveLogitsPPOActor, VisionSection()),
        "cua-dedup": (CuaPPOActor, VisionSection()),
        "cua-selective": (SelectiveLogitsPPOActor, VisionSection(dedup=False)),
    }


def _rows(actor, folder, turns: int) -> list[dict]:
    from cua_rl.testing.actor import group_rows, vision_geometry

    vocab = actor.model.get_output_embeddings().weight.shape[0]
    patch_dim, merge = vision_geometry(folder)
    return group_rows(
        turns, window=1, vocab_size=vocab, patch_dim=patch_dim, merge=merge,
        image_tokens=64, prompt_tokens=40, step_tokens=12, sampled_tokens=24,
    )  # fmt: skip


def _step(actor, rows) -> None:
    from cua_rl.testing.actor import delivered

    rows = copy.deepcopy(rows)
    for row, logp in zip(rows, actor.compute_logp(delivered(copy.deepcopy(rows))), strict=True):
        row["prox_logp"] = logp
    actor.export_stats()
    batch = actor.compute_advantages(delivered(rows))
    actor.export_stats()
    actor.ppo_update(delivered(batch))
    actor.export_stats()


def _cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def bookkeeping(turns: int, image_tokens: int = 1296, hidden: int = 1536) -> None:
    """The project's own work per micro-batch at the GPU bench's sizes (Qwen2-VL-2B's hidden
    size, ~1 MP screenshots of 1,296 merged tokens), current-only rows of 2 episodes: the image
    plan, and the gather of the tower's output (forward and gradient) that rows whose images
    all differ no longer need (``plan.token_index`` is None for them)."""
    import torch

    from cua_rl.areal.vision_dedup import plan_images

    side = int(image_tokens**0.5) * 2
    patch_dim = 3 * 2 * 14 * 14
    gen = torch.Generator().manual_seed(0)
    media = [
        {
            "pixel_values": torch.randn(side * side, patch_dim, generator=gen),
            "image_grid_thw": torch.tensor([[1, side, side]]),
            "image_keys": torch.tensor([i]),
        }
        for i in range(2 * turns)
    ]
    start = time.process_time()
    plan = plan_images(media, merge=2)
    planned = time.process_time() - start
    tokens = 2 * turns * image_tokens
    out = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    index = torch.arange(tokens)
    start = time.process_time()
    out[index].sum().backward()
    gathered = time.process_time() - start
    print(
        f"bookkeeping, {2 * turns} current-only rows of {image_tokens} image tokens: image plan "
        f"{planned:.2f} CPU s (index {'none' if plan.token_index is None else 'planned'}); "
        f"the tower-output gather it skips: {gathered:.2f} CPU s forward and backward "
        f"({tokens} x {hidden} bf16)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--profile", default="", choices=["", *_actors()], help="its operators against AReaL's"
    )
    ap.add_argument("--actors", nargs="+", default=list(_actors()), choices=list(_actors()))
    ap.add_argument("--bookkeeping-turns", type=int, default=30, help="0: skip that part")
    args = ap.parse_args()

    import gpu_actor
    import torch
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig

    from cua_rl.testing.actor import actor_config, make_actor

    torch.set_num_threads(1)  # one core: the shared machine's other core does not move it
    if args.bookkeeping_turns:
        bookkeeping(args.bookkeeping_turns)
    folder = gpu_actor.model_dir(small=True)
    gpu_actor.random_init_instead_of_loading()
    times: dict[str, float] = {}
    profiles = {}
    for name in args.actors:
        cls, vision = _actors()[name]
        config = actor_config(
            folder,
            vision=vision,
            mb_spec=MicroBatchSpec(max_tokens_per_mb=8192),
            optimizer=OptimizerConfig(lr=1e-6, weight_decay=0.0),
        )
        actor = make_actor(cls, config)
        try:
            rows = _rows(actor, folder, args.turns)
            _step(actor, rows)  # warm-up
            times[name] = statistics.median(
                _cpu_seconds(functools.partial(_step, actor, rows)) for _ in range(args.repeat)
            )
            if args.profile and name in ("areal", args.profile):
                with torch.profiler.profile() as prof:
                    _step(actor, rows)
                profiles[name] = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
        finally:
            actor.destroy()
    base = times.get("areal")
    tokens = sum(int(r["input_ids"].numel()) for r in rows)
    print(f"current-only rows: {len(rows)} rows, {tokens} tokens, {len(rows)} distinct screenshots")
    for name, seconds in times.items():
        ratio = f"{seconds / base:.2f}x AReaL's" if base else ""
        print(f"  {name:20s} {seconds:7.2f} CPU s per step  {ratio}")
    if len(profiles) == 2:
        ours, theirs = profiles[args.profile], profiles["areal"]
        diff = sorted(
            set(ours) | set(theirs),
            key=lambda k: abs(ours.get(k, 0) - theirs.get(k, 0)),
            reverse=True,
        )
        print(f"operators, self CPU ms ({args.profile}, areal, difference), largest first:")
        for key in diff[:20]:
            c, a = ours.get(key, 0) / 1e3, theirs.get(key, 0) / 1e3
            print(f"  {key[:60]:60s} {c:9.1f} {a:9.1f} {c - a:+9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
