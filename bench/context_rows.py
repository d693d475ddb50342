"""What training every call costs, per context policy: rows, tokens, processor runs, memory.

An episode of N turns with a new phone screenshot (1080x2400 PNG) at every step, laid out as
each context policy builds its requests (docs/agent.md):

- ``full``: the append-only conversation (every screenshot in every later prompt);
- ``mai-ui``: MAI-UI's window (``history_n`` = 3: the current screenshot and the two before it;
  earlier steps keep only their text, re-rendered from the parsed action, never the sampled ids);
- ``current``: the current screenshot only, with a textual list of the earlier actions.

Prompt and sampled ids are synthetic (40 sampled tokens per turn), the image pad runs are the
Qwen2-VL processor's at its released pixel budget (3,354 pads for 1080x2400), and the rows are
built by the production converter (``convert_turns``). Each case runs in a child process so its
peak RSS is its own. Printed per policy and length: rows per episode, trained/sampled tokens,
tokens forwarded per sampled token, processor runs per distinct image, the converter's peak of
held processed images and the child's peak RSS above its start, the rows' ``pixel_values`` size,
and the gateway's CPU per call for its pad counts (the resize rule, ``cua_rl.gateway.vision``)
against the processor it replaced. Not a timed test.

    .venv/bin/python bench/context_rows.py [--turns 10 30 50] [--policies full mai-ui current]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

POLICIES = ("full", "mai-ui", "current")
SAMPLED = 40
HISTORY_N = 3
MIB = 1 << 20


def processor():
    """The tiny BPE model's tokenizer with Qwen2-VL's released image budget."""
    from transformers import AutoProcessor, Qwen2VLImageProcessorFast

    from cua_rl.testing.cache import ensure_model
    from cua_rl.testing.models import processor_kwargs

    proc = AutoProcessor.from_pretrained(ensure_model("qwen2-vl-bpe"))
    proc.image_processor = Qwen2VLImageProcessorFast(**processor_kwargs(14, 3136, 12_845_056))
    return proc


def episode(policy: str, turns: int, proc) -> tuple[list, dict]:
    """The episode's turns (token ids as the policy's requests would give them) and images."""
    import hashlib

    from gateway_cpu import screenshot

    from cua_rl.gateway.vision import PadCounter
    from cua_rl.trajectory import Turn
    from cua_rl.trajectory.config import TrajectoryConfig

    tok = proc.tokenizer
    vs, ve, pad = (
        tok.convert_tokens_to_ids(t)
        for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
    )
    end = tok.convert_tokens_to_ids("<|im_end|>")
    counter = PadCounter(proc.image_processor, TrajectoryConfig())
    shots = [screenshot(1080, 2400, seed) for seed in range(turns)]
    keys = ["sha256:" + hashlib.sha256(s).hexdigest() for s in shots]
    pads = [counter.counts([s])[0] for s in shots]
    text = list(range(300, 330))  # an instruction / a user message's words

    def image(i: int) -> list[int]:
        return [vs] + [pad] * pads[i] + [ve]

    out, prompt, history = [], text[:20], []
    for t in range(turns):
        sampled = [400 + (t * 7 + k) % 200 for k in range(SAMPLED - 1)] + [end]
        if policy == "full":
            prompt = prompt + text[:8] + image(t)
            urls = keys[: t + 1]
        elif policy == "mai-ui":
            # Earlier steps as re-rendered text (ids the model never sampled), the last
            # history_n - 1 of them with their screenshot, then the current one.
            first = max(0, t - (HISTORY_N - 1))
            prompt = list(text[:20])
            for j in range(t):
                prompt += [600 + j % 50] * 12 + (image(j) if j >= first else [])
            prompt += image(t)
            urls = keys[first : t + 1]
        else:
            prompt = text[:20] + [700 + j % 50 for j in range(3 * t)] + image(t)
            urls = keys[t : t + 1]
        out.append(
            Turn(
                step=t + 1,
                index=t,
                prompt_ids=list(prompt),
                output_ids=sampled,
                output_logprobs=[-0.5] * SAMPLED,
                finish_reason="stop",
                image_urls=urls,
                messages=None,
                text="x",
                output_versions=[0] * SAMPLED,
            )
        )
        history.append(sampled)
        if policy == "full":
            prompt = prompt + sampled
    return out, dict(zip(keys, shots, strict=True))


def measure(policy: str, turns: int) -> dict:
    """One case, in this (child) process."""
    import torch

    from cua_rl.trajectory import convert_turns

    torch.set_num_threads(1)
    proc = processor()
    turns_, images = episode(policy, turns, proc)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()
    res = convert_turns(
        turns_, processor=proc, reward=1.0, version=0, fetched_images=images, episode_id=1
    )
    cpu = time.process_time() - start
    assert res.ok, (res.reason, res.detail)
    s = res.stats
    pixels = sum(r["multi_modal_input"][0]["pixel_values"].numel() * 4 for r in res.rows)
    return {
        "policy": policy,
        "turns": turns,
        "rows": s["rows"],
        "sampled": s["sampled_tokens"],
        "trained": s["trained_tokens"],
        "forwarded_per_sampled": s["row_tokens"] / s["sampled_tokens"],
        "runs_per_image": s["processed_images"] / s["distinct_images"],
        "images_in_rows": s["images"],
        "held_mib": s["image_cache_peak_bytes"] / MIB,
        "rss_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024,
        "pixel_mib": pixels / MIB,
        "convert_s": cpu,
    }


def gateway_cpu() -> tuple[float, float]:
    """CPU ms per new 1080x2400 screenshot's pad count: the resize rule, the processor."""
    from gateway_cpu import counter, cpu_ms, screenshot

    shots = [screenshot(1080, 2400, 1000 + i) for i in range(5)]
    rule, _ = cpu_ms(counter(14, 12_845_056, rule=True), shots)
    proc, _ = cpu_ms(counter(14, 12_845_056, rule=False), shots)
    return rule, proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--turns", type=int, nargs="+", default=[10, 30, 50])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--child", nargs=2, metavar=("POLICY", "TURNS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]))))
        return 0
    print(
        "| policy | turns | rows | trained / sampled tokens | forwarded per sampled | "
        "processor runs per image | images in rows | held images MiB | peak RSS MiB | "
        "rows' pixel_values MiB | convert CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for policy in args.policies:
        for n in args.turns:
            cmd = [sys.executable, __file__, "--child", policy, str(n)]
            r = json.loads(
                subprocess.run(
                    cmd, check=True, capture_output=True, text=True, env=env
                ).stdout.splitlines()[-1]
            )
            print(
                f"| {policy} | {n} | {r['rows']} | {r['trained']} / {r['sampled']} | "
                f"{r['forwarded_per_sampled']:.0f} | {r['runs_per_image']:.2f} | "
                f"{r['images_in_rows']} | {r['held_mib']:.0f} | {r['rss_mib']:.0f} | "
                f"{r['pixel_mib']:.0f} | {r['convert_s']:.1f} |",
                flush=True,
            )
    rule, proc = gateway_cpu()
    print(
        f"\ngateway CPU per call for a new 1080x2400 screenshot's pad count: {rule:.2f} ms by the "
        f"resize rule, {proc:.0f} ms by the processor ({proc / max(rule, 1e-3):.0f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
