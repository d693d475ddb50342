"""The gateway's CPU time per call for a new phone screenshot: its pad count by the image
processor (before) against the resize rule read from the image's size (after, ``vision``).

A synthetic 1080x2400 screenshot (status bar, app bar, list rows with text, a keyboard-like
grid: flat colours with edges, as a phone screen is; about the PNG size of a real one) and its
2400x1080 rotation, each a new image per call (a new hash: nothing cached). Pad counting as the
session does it (``PadCounter.counts``), under ``time.process_time`` (CPU of this process, all
threads), for the released pixel budgets of Qwen2.5-VL and Qwen3-VL (the recommended ones and
the released defaults). Printed: a table of CPU ms per call (median of ``--calls``), the ratio,
and the PNG sizes; then whole calls over HTTP (``session_cpu_ms``), before and after. Not a timed test: the goal (at most 10 ms per call at phone size) is read off
the table.

    .venv/bin/python bench/gateway_cpu.py [--calls 10]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

from PIL import Image, ImageDraw

from cua_rl.gateway.vision import PadCounter
from cua_rl.testing.models import processor_kwargs
from cua_rl.trajectory.config import TrajectoryConfig

BUDGETS = {
    # name: (patch, max_pixels)
    "qwen2.5-vl recommended": (14, 1_003_520),
    "qwen2.5-vl released": (14, 12_845_056),
    "qwen3-vl recommended": (16, 1_048_576),
    "qwen3-vl released": (16, 16_777_216),
}


def screenshot(width: int, height: int, seed: int) -> bytes:
    img = Image.new("RGB", (width, height), (250, 250, 250))
    draw = ImageDraw.Draw(img)
    draw.rectangle((0, 0, width, 80), fill=(30, 30, 30))
    draw.rectangle((0, 80, width, 260), fill=(20 + seed % 200, 110, 220))
    for row in range(12):
        top = 300 + row * 150
        draw.ellipse((40, top + 20, 140, top + 120), fill=((seed * 7 + row * 40) % 255, 160, 90))
        for line in range(3):
            draw.text((170, top + 25 + line * 30), f"Item {seed}-{row} line {line} " * 3, (0, 0, 0))
        draw.line((0, top + 145, width, top + 145), fill=(220, 220, 220), width=2)
    for key in range(40):
        x, y = (key % 10) * (width // 10), height - 400 + (key // 10) * 100
        draw.rounded_rectangle((x + 6, y + 6, x + width // 10 - 6, y + 94), 12, (200, 200, 205))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def counter(patch: int, max_pixels: int, *, rule: bool) -> PadCounter:
    from transformers import Qwen2VLImageProcessorFast

    improc = Qwen2VLImageProcessorFast(**processor_kwargs(patch, 4 * patch * patch, max_pixels))
    c = PadCounter(improc, TrajectoryConfig())
    if not rule:
        c.rule = None  # the processor path, as every call ran before
    return c


def cpu_ms(c: PadCounter, shots: list[bytes]) -> tuple[float, int]:
    times, pads = [], 0
    for raw in shots:
        start = time.process_time()
        (pads,) = c.counts([raw])
        times.append((time.process_time() - start) * 1000)
    return statistics.median(times), pads


def session_cpu_ms(shots: list[bytes], turns: int, *, rule: bool) -> float:
    """CPU per call of whole calls over HTTP (the gateway, the stand-in model server and this
    client in one process: an upper bound of the gateway's own), each turn a new screenshot and
    the whole history re-sent, Qwen3-VL's recommended budget."""
    import base64

    import httpx
    from transformers import AutoProcessor

    from cua_rl.gateway import Gateway, GatewayConfig, Sampling, SessionSpec
    from cua_rl.serving import ThreadedServer
    from cua_rl.testing.cache import ensure_model
    from cua_rl.testing.model_standin import ModelStandIn, StaticEngine

    processor = AutoProcessor.from_pretrained(ensure_model("qwen3-vl"))
    processor.image_processor.size = {"shortest_edge": 65_536, "longest_edge": 1_048_576}
    standin = ModelStandIn()
    with ThreadedServer(standin.app, name="standin") as server:
        gw = Gateway(GatewayConfig()).start()
        try:
            spec = SessionSpec(
                StaticEngine(f"{server.host}:{server.port}"),
                Sampling(max_new_tokens=4, max_tokens=262_144),
                processor,
                "p",
                TrajectoryConfig(),
            )
            url = gw.open("ep", spec)
            if not rule:
                gw._lookup("ep")._counter.rule = None
            messages: list[dict] = [{"role": "system", "content": "You operate a phone."}]
            times = []
            with httpx.Client(timeout=600) as http:
                for turn, raw in zip(range(turns), shots, strict=False):
                    data = "data:image/png;base64," + base64.b64encode(raw).decode()
                    parts = [{"type": "text", "text": f"Step {turn}"}]
                    parts.append({"type": "image_url", "image_url": {"url": data}})
                    messages.append({"role": "user", "content": parts})
                    start = time.process_time()
                    r = http.post(f"{url}/chat/completions", json={"messages": messages})
                    times.append((time.process_time() - start) * 1000)
                    r.raise_for_status()
                    messages.append(r.json()["choices"][0]["message"])
            gw.close("ep")
        finally:
            gw.stop()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    sizes = [(1080, 2400), (2400, 1080)]
    shots = {s: [screenshot(*s, seed=i) for i in range(args.calls)] for s in sizes}
    for (w, h), raws in shots.items():
        kib = statistics.mean(len(r) for r in raws) / 1024
        print(f"screenshot {w}x{h}: PNG {kib:.0f} KiB on average, {args.calls} distinct")
    print()
    print("| budget | image | pads | processor CPU ms/call | rule CPU ms/call | ratio |")
    print("|---|---|---|---|---|---|")
    for name, (patch, max_pixels) in BUDGETS.items():
        for (w, h), raws in shots.items():
            before, pads_before = cpu_ms(counter(patch, max_pixels, rule=False), raws)
            after, pads_after = cpu_ms(counter(patch, max_pixels, rule=True), raws)
            assert pads_before == pads_after, (name, w, h, pads_before, pads_after)
            print(
                f"| {name} ({max_pixels:,} px) | {w}x{h} | {pads_after} | {before:.1f} "
                f"| {after:.3f} | {before / after:,.0f}x |"
            )
    raws = shots[(1080, 2400)]
    before = session_cpu_ms(raws, args.calls, rule=False)
    after = session_cpu_ms(raws, args.calls, rule=True)
    print()
    print("Whole calls over HTTP, 1080x2400 screenshot per turn, history re-sent (median):")
    print("| pad count by | CPU ms per call (gateway + stand-in + client) |")
    print("|---|---|")
    print(f"| the processor | {before:.1f} |")
    print(f"| the rule | {after:.1f} |")


if __name__ == "__main__":
    main()
