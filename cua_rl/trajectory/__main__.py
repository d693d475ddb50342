"""``python -m cua_rl.trajectory convert --events FILE --processor MODEL_DIR [--out ROW.pt]``.

Converts one saved event log offline and prints a one-line JSON summary. Only data: URL images
are read; a log with http(s) screenshots needs ``--allow-host`` and fetches them first (the one
network step, kept outside the converter).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from cua_rl.errors import ConfigError, RejectedEpisode


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cua_rl.trajectory")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="event log -> training row summary (and row file)")
    conv.add_argument("--events", required=True, help="JSON file: {'events': [...]} or a list")
    conv.add_argument("--processor", required=True, help="model folder with the processor")
    conv.add_argument("--out", help="save the row dict here with torch.save")
    conv.add_argument("--reward", type=float, default=0.0, help="reward to put in the row")
    conv.add_argument("--version", type=int, default=0, help="policy version of generated tokens")
    conv.add_argument(
        "--prefix-break-policy", default="rows", choices=("rows", "last_segment", "reject")
    )
    conv.add_argument(
        "--allow-host", action="append", default=[], help="image host allowed for http(s) URLs"
    )
    return parser


def _convert(args) -> int:
    from transformers import AutoProcessor

    from cua_rl.trajectory import (
        ConversionResult,
        TrajectoryConfig,
        convert_turns,
        events_to_turns,
        fetch_images,
        image_urls_needed,
        row_summary,
    )

    config = TrajectoryConfig(
        prefix_break_policy=args.prefix_break_policy, allowed_image_hosts=tuple(args.allow_host)
    )
    text = Path(args.events).read_text()
    try:
        parsed = events_to_turns(text)
        fetched = asyncio.run(fetch_images(image_urls_needed(parsed.turns, config), config))
    except RejectedEpisode as exc:
        result = ConversionResult(None, exc.reason, exc.detail, {"turns": 0})
    else:
        processor = AutoProcessor.from_pretrained(args.processor)
        result = convert_turns(
            parsed.turns,
            processor=processor,
            reward=args.reward,
            version=args.version,
            config=config,
            fetched_images=fetched,
        )
    if result.ok and args.out:
        import torch

        torch.save(result.row, args.out)
    print(json.dumps(row_summary(result), sort_keys=True))
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _convert(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
