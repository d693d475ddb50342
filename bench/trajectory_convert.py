"""Cost of turning a long episode into one training row.

Synthesises an N-turn episode (default 30) with one phone screenshot per turn (rendered by the
sim phone) in the agent's event format: append-only history, so turn t's prompt ids are turn
t-1's prompt + output + a new user message with one more image. Prompt ids are built with the
real tokenizer and the pad-token counts with the model's real image processor, so the converter
does all of its real work (prefix checks, pad checks, image decoding and processing). No vLLM.

Prints: conversion time per turn; the merged row's size against the per-turn-sample
alternative (one row per model call, each carrying its whole prompt and re-processing every
screenshot so far); and the converter's peak memory against the size of the pixel values.
The conversion runs in a fresh child process so its peak RSS is its own.

    python bench/trajectory_convert.py [--turns 30] [--model-dir DIR] [--repeat 3]
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing as mp
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def synthesise(
    model_dir: str,
    turns: int,
    seed: int = 0,
    *,
    processor=None,
    size: tuple[int, int] | None = None,
) -> list[dict]:
    """``processor`` (default: the model's) counts the pad tokens; ``size`` is the screen's."""
    from transformers import AutoProcessor

    from cua_rl.sim.phone import Phone
    from cua_rl.sim.phone_render import render_png
    from cua_rl.sim.phone_tasks import TASKS, initial_state

    proc = processor or AutoProcessor.from_pretrained(model_dir)
    tok = proc.tokenizer
    rng = random.Random(seed)
    phone = Phone(initial_state(TASKS[0], seed), *(size or ()))
    vs, ve, pad, im_end = (
        tok.convert_tokens_to_ids(t)
        for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|im_end|>")
    )

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    from io import BytesIO

    from PIL import Image

    messages = [
        {"role": "system", "content": "You operate a phone."},
        {"role": "user", "content": "Task: turn Wi-Fi on."},
    ]
    ids = enc("<|im_start|>system\nYou operate a phone.<|im_end|>\n")
    ids += enc("<|im_start|>user\nTask: turn Wi-Fi on.<|im_end|>\n")
    events: list[dict] = []
    ts = 1_700_000_000_000
    actions = ["tap(60, 130)", "swipe(10, 300, 300, 300)", "home()", "back()", 'type("wifi")']
    for step in range(1, turns + 1):
        phone.state.brightness = (phone.state.brightness + 5) % 100  # a different screen
        png = render_png(phone)
        grid = proc.image_processor(
            images=[Image.open(BytesIO(png)).convert("RGB")], return_tensors="pt"
        )["image_grid_thw"][0]
        n_pad = int(grid.prod()) // proc.image_processor.merge_size**2
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        messages.append(
            {"role": "user", "content": [{"type": "text", "text": f"Step {step}."},
                                         {"type": "image_url", "image_url": {"url": url}}]}
        )  # fmt: skip
        ids += enc(f"<|im_start|>user\nStep {step}.") + [vs] + [pad] * n_pad + [ve, im_end]
        ids += enc("\n<|im_start|>assistant\n")
        text = rng.choice(actions)
        out = enc(text) + [im_end]
        lps = [-rng.random() * 3 for _ in out]
        req = {"model": "tiny", "messages": [dict(m) for m in messages], "logprobs": True}
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
            "token_ids": out,
            "logprobs": {"content": [{"token": "", "logprob": x} for x in lps]},
        }
        for ev in (
            {"type": "step_start", "step": step},
            {"type": "model_call", "step": step, "modelSpecificInput": req},
            {"type": "model_output", "step": step,
             "modelOutput": {"choices": [choice], "prompt_token_ids": list(ids)}},
            {"type": "action_executed", "step": step, "actionIndex": 0,
             "action": {"name": text.split("(")[0], "args": {}, "rawResult": {"ok": True}}},
            {"type": "step_end", "step": step},
        ):  # fmt: skip
            ts += 7
            events.append({**ev, "ts": ts})
        messages.append({"role": "assistant", "content": text})
        ids = ids + out + enc("\n")
    return events


def _child(model_dir: str, log_path: str, repeat: int, conn) -> None:
    import torch
    from transformers import AutoProcessor

    from cua_rl.trajectory import convert_turns, events_to_turns

    torch.set_num_threads(1)
    proc = AutoProcessor.from_pretrained(model_dir)
    events = json.loads(Path(log_path).read_text())
    # Warm once (lazy imports, allocator), then measure.
    convert_turns(events_to_turns(events[:5]).turns, processor=proc, reward=0.0, version=0)
    base_rss = _rss_mib()
    times = []
    result = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        parsed = events_to_turns(events)
        result = convert_turns(parsed.turns, processor=proc, reward=1.0, version=0)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row = result.row
    pv = row["multi_modal_input"][0]["pixel_values"]
    # The per-turn-sample alternative: one row per model call with its whole prompt.
    per_turn_tokens = sum(len(t.prompt_ids) + len(t.output_ids) for t in parsed.turns)
    per_turn_images = sum(len(t.image_urls) for t in parsed.turns)
    per_turn_trained = sum(len(t.output_ids) for t in parsed.turns)
    tensor_bytes = sum(v.numel() * v.element_size() for v in row.values() if torch.is_tensor(v))
    conn.send(
        {
            "ok": result.ok,
            "reason": result.reason,
            "times": times,
            "turns": len(parsed.turns),
            "row_len": row["input_ids"].shape[1],
            "trained": int(row["loss_mask"].sum()),
            "per_turn_tokens": per_turn_tokens,
            "per_turn_trained": per_turn_trained,
            "per_turn_images": per_turn_images,
            "images": row["multi_modal_input"][0]["image_grid_thw"].shape[0],
            "pixel_bytes": pv.numel() * pv.element_size(),
            "pixel_shape": list(pv.shape),
            "row_tensor_bytes": tensor_bytes,
            "log_bytes": Path(log_path).stat().st_size,
            "base_rss": base_rss,
            "peak_rss": peak,
        }
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model-dir", help="tiny Qwen2-VL folder (default: build/reuse cache)")
    args = parser.parse_args(argv)
    model_dir = args.model_dir
    if not model_dir:
        from cua_rl.testing.cache import ensure_model

        model_dir = str(ensure_model("qwen2-vl-byte"))
    events = synthesise(model_dir, args.turns)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "events.json"
        log.write_text(json.dumps(events))
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_child, args=(model_dir, str(log), args.repeat, child))
        p.start()
        r = parent.recv()
        p.join(timeout=60)
    if not r["ok"]:
        print(f"conversion rejected: {r['reason']}")
        return 1
    best = min(r["times"])
    mib = 1024 * 1024
    print(
        f"episode: {r['turns']} turns, {r['images']} screenshots, event log {r['log_bytes'] / mib:.1f} MiB"
    )
    print(
        f"conversion: {best * 1000:.1f} ms total, {best / r['turns'] * 1000:.2f} ms/turn "
        f"(best of {len(r['times'])}: {', '.join(f'{t * 1000:.0f}' for t in r['times'])} ms)"
    )
    print(
        f"merged row: {r['row_len']} tokens, {r['trained']} trained, {r['images']} images processed"
    )
    print(
        f"per-turn samples: {r['per_turn_tokens']} tokens, {r['per_turn_trained']} trained, "
        f"{r['per_turn_images']} images processed"
    )
    print(
        f"trained tokens: merged row {r['trained']} vs per-turn samples {r['per_turn_trained']} "
        f"({r['per_turn_trained'] / r['trained']:.2f}x); "
        f"tokens forwarded: {r['per_turn_tokens']} vs {r['row_len']} "
        f"({r['per_turn_tokens'] / r['row_len']:.1f}x); images processed "
        f"{r['per_turn_images']} vs {r['images']} ({r['per_turn_images'] / r['images']:.1f}x)"
    )
    print(
        f"trained tokens per forwarded token: merged {r['trained'] / r['row_len']:.3f}, "
        f"per-turn {r['per_turn_trained'] / r['per_turn_tokens']:.3f}"
    )
    delta = r["peak_rss"] - r["base_rss"]
    print(
        f"pixel_values: {r['pixel_shape']} float32 = {r['pixel_bytes'] / mib:.2f} MiB; "
        f"other row tensors {r['row_tensor_bytes'] / mib:.2f} MiB"
    )
    print(
        f"peak RSS during conversion: {r['peak_rss']:.0f} MiB (baseline {r['base_rss']:.0f} MiB, "
        f"+{delta:.1f} MiB = {delta * mib / max(r['pixel_bytes'], 1):.1f}x pixel_values)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
