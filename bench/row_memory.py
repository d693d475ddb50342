"""Peak memory and time of one actor update on a long screenshot row: AReaL's logits against
selective logits (cua_rl/areal/logits.py).

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

    python bench/row_memory.py [--turns 5 10 20] [--image-tokens 64]
                               [--screenshot-sizes 64 256] [--repeat 2]

A second sweep keeps the first row's turns and trained tokens and grows its screenshots: the
update's peak should then grow with the row on AReaL's path and stay nearly flat with selective
logits.
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

    from cua_rl.areal.logits_engine import SelectiveLogitsPPOActor
    from cua_rl.testing.actor import actor_config, make_actor, screenshot_row
    from cua_rl.testing.cache import ensure_model
    from cua_rl.testing.memory import peak_rss, release_freed_memory
    from cua_rl.testing.models import WIDE_VOCAB

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


_measured: dict[tuple[int, int, str], dict] = {}


def sweep(title: str, cases: list[tuple[int, int]], repeat: int) -> list[tuple[dict, dict]]:
    """Both paths for each (turns, image tokens per screenshot); one table line per case."""
    from cua_rl.testing.models import WIDE_VOCAB

    print(f"\n{title}")
    print(
        f"{'turns':>5} {'shot':>4} {'tokens':>6} {'trained':>7} {'row logits':>10} | "
        f"{'update peak: areal':>18} {'selective':>9} {'ratio':>5} | "
        f"{'update s: areal':>15} {'selective':>9} | "
        f"{'logp peak: areal':>16} {'selective':>9} | {'logp s: areal':>13} {'selective':>9}"
    )
    results = []
    for turns, shot in cases:
        for mode in MODES:  # a case both sweeps share is measured once
            if (turns, shot, mode) not in _measured:
                _measured[turns, shot, mode] = run_child(turns, mode, shot, repeat)
        a, s = (_measured[turns, shot, mode] for mode in MODES)
        results.append((a, s))
        print(
            f"{turns:>5} {shot:>4} {a['tokens']:>6} {a['trained']:>7} "
            f"{a['tokens'] * WIDE_VOCAB * 4 / GIB:>8.2f} G | "
            f"{a['update_added'] / GIB:>16.2f} G {s['update_added'] / GIB:>7.2f} G "
            f"{a['update_added'] / s['update_added']:>5.1f} | "
            f"{a['update_s']:>15.2f} {s['update_s']:>9.2f} | "
            f"{a['logp_added'] / GIB:>14.2f} G {s['logp_added'] / GIB:>7.2f} G | "
            f"{a['logp_s']:>13.2f} {s['logp_s']:>9.2f}",
            flush=True,
        )
        if abs(s["grad_norm"] - a["grad_norm"]) > 1e-5 * abs(a["grad_norm"]):
            print(f"  grad_norm differs: areal {a['grad_norm']}, selective {s['grad_norm']}")
    return results


def growth(results: list[tuple[dict, dict]], per: str) -> str:
    """Added update peak between the first and last case, in fp32 logits rows per token."""
    from cua_rl.testing.models import WIDE_VOCAB

    (a0, s0), (a1, s1) = results[0], results[-1]
    tokens = a1[per] - a0[per]
    row = WIDE_VOCAB * 4

    def rows(first: dict, last: dict) -> float:
        return (last["update_added"] - first["update_added"]) / tokens / row

    return f"areal {rows(a0, a1):.2f}, selective {rows(s0, s1):.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[5, 10, 20])
    parser.add_argument("--image-tokens", type=int, default=64)
    parser.add_argument(
        "--screenshot-sizes",
        type=int,
        nargs="*",
        default=[64, 256],
        help="image tokens per screenshot for a second sweep at the first --turns value",
    )
    parser.add_argument("--repeat", type=int, default=2, help="measured steps after the warm-up")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.turns[0], args.child, args.image_tokens, args.repeat)))
        return 0

    print("device: CPU only (no GPU in this session); model qwen2-vl-wide (151,936 ids), fp32")
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("per turn: 60 prompt tokens, one screenshot ('shot' image tokens + 2), 40 sampled")
    print("peaks are above the RSS before the call; 'row logits' = fp32 logits of every token")
    by_turns = sweep(
        "rows of more turns (trained tokens grow with the row)",
        [(t, args.image_tokens) for t in args.turns],
        args.repeat,
    )
    if len(by_turns) > 1:
        print(
            "update peak growth, fp32 logits rows per added trained token: "
            + growth(by_turns, "trained")
        )
    if len(args.screenshot_sizes) > 1:
        by_size = sweep(
            f"{args.turns[0]} turns, bigger screenshots (same trained tokens)",
            [(args.turns[0], size) for size in args.screenshot_sizes],
            args.repeat,
        )
        print(
            "update peak growth, fp32 logits rows per added row token: " + growth(by_size, "tokens")
        )
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
