"""What encoding each screenshot once per micro-batch saves, per context policy and length.

A step of two episodes (one GRPO group of 2) of N turns, a new screenshot at every turn, laid
out by ``cua_rl.testing.actor.window_rows`` as each context policy sends its calls:

- ``full``: the append-only conversation (one row per episode, every screenshot once);
- ``window-5`` (UI-TARS), ``window-3`` (MAI-UI): one row per call, the last 5 or 3 screenshots;
- ``current``: one row per call, the current screenshot only.

Each step goes through two real AReaL actors on CPU (fp32, the tiny Qwen2-VL, 36 merged tokens
and 144 patches per screenshot by default): AReaL's ``FSDPPPOActor`` (today's path) and ``CuaPPOActor``
(``actor.vision``'s defaults: dedup, episodes packed in turn order), and for the encoded count
also dedup in AReaL's own micro-batches (``pack_episodes`` off, "unpacked"). Printed per policy
and length: rows, tokens, images the rows hold, screenshots the episodes have, images the vision
tower encoded in ``ppo_update`` (a hook counts them), micro-batches of the step (today/dedup, at
``--mb-tokens``), and the CPU time of ``ppo_update`` (forward + backward + optimizer step, lr 0), the best of
``--repeat`` runs, with the ratio of this path's time to today's. Not a timed test; timings are
this machine's, and the tiny model's vision tower is a small share of its step. The advantages
are computed once, by ``CuaPPOActor`` (AReaL's ``compute_advantages`` hands every row a copy of
the whole step's pixels: at 30 turns of 5-screenshot rows that alone ran out of 24 GiB).

    .venv/bin/python bench/vision_dedup.py [--turns 10 30] [--repeat 3] [--mb-tokens 4096]
        [--image-tokens 36]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLICIES = {"full": None, "window-5": 5, "window-3": 3, "current": 1}


def _actors(mb_tokens: int):
    from areal.engine.fsdp_engine import FSDPPPOActor

    from cua_rl.areal.actor import CuaPPOActor
    from cua_rl.areal.attention import keep_packed_sequences_apart
    from cua_rl.testing.actor import actor_config, make_actor
    from cua_rl.testing.cache import ensure_model

    keep_packed_sequences_apart()
    model_dir = ensure_model("qwen2-vl-byte")
    config = actor_config(model_dir)
    config.mb_spec.max_tokens_per_mb = mb_tokens
    unpacked = copy.deepcopy(config)
    unpacked.vision.pack_episodes = False
    return (
        make_actor(FSDPPPOActor, copy.deepcopy(config)),
        make_actor(CuaPPOActor, config),
        make_actor(CuaPPOActor, unpacked),
    )


def _step_rows(policy: str, turns: int, vocab: int, image_tokens: int) -> list[dict]:
    from cua_rl.testing.actor import window_rows

    return [
        row
        for seed in (1, 2)
        for row in window_rows(
            turns,
            window=POLICIES[policy],
            vocab_size=vocab,
            image_tokens=image_tokens,
            prompt_tokens=40,
            step_tokens=20,
            sampled_tokens=30,
            seed=seed,
        )
    ]


class Encoded:
    """Images the vision tower encodes, and the micro-batches of the last ``ppo_update``."""

    def __init__(self, actor):
        from cua_rl.areal.vision_dedup import vision_tower

        self.images = 0
        vision_tower(actor.model).register_forward_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs, output):
        self.images += int(kwargs["grid_thw"].shape[0])


def _update(actor, counter: Encoded, batch: list[dict]) -> tuple[float, int, int]:
    """(CPU seconds, images encoded, micro-batches) of one ppo_update."""
    batch = copy.deepcopy(batch)
    counter.images = 0
    start = time.process_time()
    actor.ppo_update(batch)
    seconds = time.process_time() - start
    stats = actor.export_stats()
    return seconds, counter.images, int(stats.get("ppo_actor/update/num_micro_batches", 0))


def measure(actors, counters, policy: str, turns: int, repeat: int, image_tokens: int) -> dict:
    areal = actors[0]
    vocab = areal.model.get_output_embeddings().weight.shape[0]
    rows = _step_rows(policy, turns, vocab, image_tokens)
    for row, logp in zip(rows, areal.compute_logp(copy.deepcopy(rows)), strict=True):
        row["prox_logp"] = logp
    areal.export_stats()
    # CuaPPOActor's compute_advantages: AReaL's would give each row a copy of every row's
    # pixels (rows x rows; the 30-turn 5-screenshot step ran this machine out of memory).
    batch = actors[1].compute_advantages(copy.deepcopy(rows))
    actors[1].export_stats()
    out = {
        "policy": policy,
        "turns": turns,
        "rows": len(rows),
        "tokens": sum(r["input_ids"].shape[1] for r in rows),
        "row_images": sum(int(r["multi_modal_input"][0]["image_grid_thw"].shape[0]) for r in rows),
        "screenshots": 2 * turns,
    }
    for name, actor, counter in zip(("today", "dedup", "unpacked"), actors, counters, strict=True):
        runs = [_update(actor, counter, batch) for _ in range(repeat if name != "unpacked" else 1)]
        out[f"{name}_s"] = min(r[0] for r in runs)
        out[f"{name}_encoded"] = runs[0][1]
        out[f"{name}_mbs"] = runs[0][2]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[10, 30])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mb-tokens", type=int, default=4096)
    parser.add_argument("--image-tokens", type=int, default=36, help="merged tokens per shot")
    args = parser.parse_args(argv)

    import torch

    torch.manual_seed(0)
    actors = _actors(args.mb_tokens)
    counters = [Encoded(a) for a in actors]
    header = (
        f"{'policy':<9} {'turns':>5} {'rows':>4} {'tokens':>6} {'images':>6} {'shots':>5} "
        f"{'enc today':>9} {'enc unpacked':>12} {'enc dedup':>9} {'mbs':>7} {'today s':>8} "
        f"{'dedup s':>8} {'dedup/today':>11}"
    )
    print(
        f"step: 2 episodes; {args.image_tokens} merged tokens per screenshot; "
        f"max_tokens_per_mb {args.mb_tokens}; CPU seconds of ppo_update, best of {args.repeat}; "
        "advantages by CuaPPOActor for both paths"
    )
    print(header)
    for turns in args.turns:
        for policy in args.policies:
            r = measure(actors, counters, policy, turns, args.repeat, args.image_tokens)
            print(
                f"{r['policy']:<9} {r['turns']:>5} {r['rows']:>4} {r['tokens']:>6} "
                f"{r['row_images']:>6} {r['screenshots']:>5} {r['today_encoded']:>9} "
                f"{r['unpacked_encoded']:>12} {r['dedup_encoded']:>9} "
                f"{r['today_mbs']:>3}/{r['dedup_mbs']:<3} {r['today_s']:>8.2f} "
                f"{r['dedup_s']:>8.2f} {r['dedup_s'] / r['today_s']:>11.2f}",
                flush=True,
            )
    for actor in reversed(actors):
        actor.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
