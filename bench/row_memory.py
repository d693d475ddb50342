"""Peak memory and time of one actor update on a long screenshot row: AReaL's logits against
selective logits (cua_rl/areal_ext/logits.py).

Each measurement runs in a fresh child process: AReaL's real FSDP PPO actor on CPU (world size
1, gloo) with the tiny Qwen2-VL of production vocabulary width ("qwen2-vl-wide": 151,936 ids,
hidden 128, 2 layers), fp32, one row of N turns laid out as cua-rl's converter does (per turn a
60-token prompt, one screenshot, 40 sampled tokens in the loss mask). One warm-up step
(torch.compile, optimizer state), then the measured step: ``compute_logp`` (forward only) and
``ppo_update`` (forward, backward, optimizer step), each with its own peak RSS above what the
process held before it (``cua_rl.testing.memory``) and its wall time; with ``--repeat`` steps
measured, the highest peak and the fastest time. Times on a shared machine are noisy: the load
average is printed with them.

This session had no GPU: every figure is CPU. The screenshots are 64 image tokens here, not the
1,280 of a million-pixel phone screenshot, so that AReaL's path fits in the memory of a small
machine; docs/logits.md puts the figures next to the H100 ones.

    python bench/row_memory.py [--turns 5 10 20] [--image-tokens 64] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 1 << 30
MODES = ("areal", "selective")


def measure(turns: int, mode: str, image_tokens: int, repeat: int) -> dict:
    """A warm-up step, then ``repeat`` measured steps: the highest peak, the fastest time."""
    import torch
    from areal.api.cli_args import OptimizerConfig
    from areal.engine.fsdp_engine import FSDPPPOActor

    from cua_rl.areal_ext.logits_engine import SelectiveLogitsPPOActor
    from cua_rl.testing.actor import actor_config, make_actor, screenshot_row
    from cua_rl.testing.memory import peak_rss, release_freed_memory
    from cua_rl.testing.models import WIDE_VOCAB, ensure_model

    release_freed_memory()
    engine = FSDPPPOActor if mode == "areal" else SelectiveLogitsPPOActor
    # One row per update: no group or batch normalisation (they need several rows); the
    # advantage is the reward, so the loss and its gradients are not zero.
    config = actor_config(
        ensure_model("qwen2-vl-wide"),
        reward_norm=None,
        adv_norm=None,
        optimizer=OptimizerConfig(lr=1e-6, weight_decay=0.0),
    )
    actor = make_actor(engine, config, dataset_size=1)

    def row() -> dict:
        return screenshot_row(turns, vocab_size=WIDE_VOCAB, image_tokens=image_tokens, seed=turns)

    logp_runs, update_runs = [], []
    for _ in range(1 + repeat):
        rows = [row()]
        with peak_rss() as logp:
            logps = actor.compute_logp(rows)
        rows[0]["prox_logp"] = logps[0]
        batch = actor.compute_advantages(rows)
        with peak_rss() as update:
            actor.ppo_update(batch)
        logp_runs.append(logp)
        update_runs.append(update)
        stats = actor.export_stats()
    logp_runs, update_runs = logp_runs[1:], update_runs[1:]
    return dict(
        turns=turns,
        mode=mode,
        tokens=int(rows[0]["input_ids"].shape[1]),
        trained=int(rows[0]["loss_mask"].sum()),
        logp_added=max(r.added for r in logp_runs),
        logp_s=min(r.seconds for r in logp_runs),
        update_added=max(r.added for r in update_runs),
        update_s=min(r.seconds for r in update_runs),
        grad_norm=stats["ppo_actor/update/grad_norm"],
        entropy=stats["ppo_actor/update/entropy/avg"],
        threads=torch.get_num_threads(),
    )


def run_child(turns: int, mode: str, image_tokens: int, repeat: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--turns", str(turns)]
    cmd += ["--image-tokens", str(image_tokens), "--repeat", str(repeat)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"child {turns} turns / {mode} failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[5, 10, 20])
    parser.add_argument("--image-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2, help="measured steps after the warm-up")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.turns[0], args.child, args.image_tokens, args.repeat)))
        return 0

    from cua_rl.testing.models import WIDE_VOCAB

    print("device: CPU only (no GPU in this session); model qwen2-vl-wide, fp32")
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"row: per turn 60 prompt + {args.image_tokens + 2} screenshot + 40 sampled tokens")
    head = (
        f"{'turns':>5} {'tokens':>6} {'trained':>7} {'logits of row':>13} | "
        f"{'update peak areal':>17} {'selective':>9} {'ratio':>5} | "
        f"{'update s areal':>14} {'selective':>9} | "
        f"{'logp peak areal':>15} {'selective':>9} | {'logp s areal':>12} {'selective':>9}"
    )
    print(head)
    results = []
    for turns in args.turns:
        a, s = (run_child(turns, mode, args.image_tokens, args.repeat) for mode in MODES)
        results.append((a, s))
        row_logits = a["tokens"] * WIDE_VOCAB * 4 / GIB
        print(
            f"{turns:>5} {a['tokens']:>6} {a['trained']:>7} {row_logits:>11.2f} G | "
            f"{a['update_added'] / GIB:>15.2f} G {s['update_added'] / GIB:>7.2f} G "
            f"{a['update_added'] / s['update_added']:>5.1f} | "
            f"{a['update_s']:>14.2f} {s['update_s']:>9.2f} | "
            f"{a['logp_added'] / GIB:>13.2f} G {s['logp_added'] / GIB:>7.2f} G | "
            f"{a['logp_s']:>12.2f} {s['logp_s']:>9.2f}",
            flush=True,
        )
        for r in (a, s):
            if abs(r["grad_norm"] - a["grad_norm"]) > 1e-5 * abs(a["grad_norm"]):
                print(f"  grad_norm differs: areal {a['grad_norm']} selective {s['grad_norm']}")
    if len(results) > 1:
        (a0, s0), (a1, s1) = results[0], results[-1]
        rows = a1["tokens"] - a0["tokens"]
        trained = a1["trained"] - a0["trained"]
        print(
            "growth of the update peak per added token of the row: areal "
            f"{(a1['update_added'] - a0['update_added']) / rows / 1024:.0f} KiB, selective "
            f"{(s1['update_added'] - s0['update_added']) / rows / 1024:.0f} KiB; "
            "per added trained token: areal "
            f"{(a1['update_added'] - a0['update_added']) / trained / 1024:.0f} KiB, selective "
            f"{(s1['update_added'] - s0['update_added']) / trained / 1024:.0f} KiB "
            f"(one fp32 logits row is {WIDE_VOCAB * 4 / 1024:.0f} KiB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
