"""``python -m cua_rl.monitor serve --db PATH [--host H] [--port N] [--token T]``.

Serves the API, the screenshot store and the dashboard (at ``/``). The token also comes from
``MONITOR_PROJECT_TOKEN``; without one everything is open (loopback use).

``python -m cua_rl.monitor export --db PATH [--training NAME ...] [filters] [--format parquet]
--out DIR`` writes stored episodes as a Hugging Face dataset, one example per trained row, with a
dataset card (``cua_rl/monitor/export.py``, docs/warehouse.md); it exits 1 with one
``export error:`` line when there is nothing to export.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys

from cua_rl.monitor.export import FORMATS
from cua_rl.monitor.server.app import DEFAULT_MAX_BODY_BYTES
from cua_rl.monitor.server.dashboard import DEFAULT_STALE_AFTER_S
from cua_rl.monitor.server.safety import DEFAULT_HEARTBEAT_TIMEOUT_S
from cua_rl.monitor.server.screenshots import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_TOTAL_BYTES,
    ScreenshotStore,
)

USAGE = "usage: python -m cua_rl.monitor serve --db PATH [--host H] [--port N] [--token T]"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cua_rl.monitor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the ingest API and the dashboard reads")
    serve.add_argument("--db", required=True, help="SQLite file (created and migrated if needed)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8765, help="TCP port (default 8765)")
    serve.add_argument(
        "--token",
        default=None,
        help="project token for Bearer auth (default: $MONITOR_PROJECT_TOKEN)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest accepted request body (default {DEFAULT_MAX_BODY_BYTES})",
    )
    serve.add_argument(
        "--screenshots-dir",
        default=None,
        help="screenshot store folder (default: beside the database, <db name>.screenshots)",
    )
    serve.add_argument(
        "--screenshot-max-bytes",
        type=int,
        default=DEFAULT_MAX_IMAGE_BYTES,
        help=f"largest accepted screenshot (default {DEFAULT_MAX_IMAGE_BYTES})",
    )
    serve.add_argument(
        "--screenshot-retention-mb",
        type=float,
        default=DEFAULT_MAX_TOTAL_BYTES / 2**20,
        help="retention: the store keeps at most this many MiB, dropping the oldest images "
        f"first (default {DEFAULT_MAX_TOTAL_BYTES / 2**20:.0f})",
    )
    serve.add_argument(
        "--stale-after-s",
        type=float,
        default=DEFAULT_STALE_AFTER_S,
        help="the dashboard flags a running training whose heartbeat is older than this "
        f"(default {DEFAULT_STALE_AFTER_S:.0f})",
    )
    serve.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        help="the safety net marks an active training failed ('heartbeat lost') once it has "
        "been silent this long, and closes its open rollouts and environments; 0 turns that "
        f"off (default {DEFAULT_HEARTBEAT_TIMEOUT_S:.0f}; the trainer beats every 30 s)",
    )
    serve.add_argument("--log-level", default="warning", help="uvicorn log level")
    _export_parser(sub)
    return parser


def _export_parser(sub) -> None:
    export = sub.add_parser(
        "export", help="write stored episodes as a dataset, one example per trained row"
    )
    export.add_argument("--db", required=True, help="the monitor's SQLite file")
    export.add_argument(
        "--training",
        action="append",
        default=[],
        help="a training's run name (repeat for several; default: every training with stored "
        "episodes)",
    )
    export.add_argument("--out", required=True, help="a new folder for the dataset and its card")
    export.add_argument(
        "--format",
        choices=FORMATS,
        default="arrow",
        help="arrow: datasets' save_to_disk folder (default); parquet: one file under data/",
    )
    export.add_argument("--success-only", action="store_true", help="successful episodes only")
    export.add_argument("--min-reward", type=float, default=None, help="episodes with reward >= R")
    export.add_argument(
        "--context", default=None, help="only trainings whose agent ran this context policy"
    )
    export.add_argument("--min-step", type=int, default=None, help="training steps from N on")
    export.add_argument("--max-step", type=int, default=None, help="training steps up to N")
    export.add_argument(
        "--tokenizer",
        default=None,
        help="a local folder with the model's tokenizer, to decode the sampled turns (default: "
        "the training's tokenizer_path)",
    )
    export.add_argument(
        "--screenshots-dir",
        default=None,
        help="screenshot store folder (default: beside the database, <db name>.screenshots)",
    )


def export(args: argparse.Namespace) -> int:
    from cua_rl.monitor.export import ExportError, Filters, export_episodes

    filters = Filters(
        trainings=tuple(args.training),
        success_only=args.success_only,
        min_reward=args.min_reward,
        context=args.context,
        min_step=args.min_step,
        max_step=args.max_step,
    )
    try:
        export_episodes(
            args.db,
            args.out,
            filters,
            fmt=args.format,
            screenshots=args.screenshots_dir,
            tokenizer=args.tokenizer,
        )
    except ExportError as exc:
        print(f"export error: {exc}", file=sys.stderr)
        return 1
    return 0


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The screenshot retention in bytes, after refusing values that cannot work."""

    if args.max_body_bytes < 1024:
        parser.error("--max-body-bytes must be at least 1024")
    if args.screenshot_max_bytes < 1024:
        parser.error("--screenshot-max-bytes must be at least 1024")
    retention = int(args.screenshot_retention_mb * 2**20)
    if retention < args.screenshot_max_bytes:
        parser.error(
            "--screenshot-retention-mb must hold at least one --screenshot-max-bytes image"
        )
    if args.stale_after_s <= 0:
        parser.error("--stale-after-s must be > 0")
    if args.heartbeat_timeout_s < 0:
        parser.error("--heartbeat-timeout-s must be >= 0 (0 turns the reaping off)")
    return retention


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port) for uvicorn to serve on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # Reuse a port in TIME_WAIT (a monitor just stopped), never one a live server listens on.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def cannot_listen(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use: another monitor may serve there (open "
            f"http://{host}:{port}/), or another program holds it; stop it, or serve on another "
            "port: --port N (--port 0 picks a free one)"
        )
    return f"cannot listen on {host}:{port} ({exc.strerror or exc}): fix --host or --port"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "export":
        return export(args)
    retention = _check(parser, args)
    import uvicorn

    from cua_rl.monitor.server.app import create_app
    from cua_rl.monitor.server.store import MonitorStore

    # Bound before anything is said or opened: a port in use was announced as served, then
    # refused by uvicorn in a traceback ending "address already in use".
    try:
        sock = listen(args.host, args.port)
    except OSError as exc:
        print(f"monitor error: {cannot_listen(args.host, args.port, exc)}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    token = args.token or os.environ.get("MONITOR_PROJECT_TOKEN") or None
    store = MonitorStore(args.db)
    shots = ScreenshotStore(
        args.db,
        args.screenshots_dir,
        max_image_bytes=args.screenshot_max_bytes,
        max_total_bytes=retention,
    )
    app = create_app(
        store,
        token=token,
        max_body_bytes=args.max_body_bytes,
        screenshots=shots,
        stale_after_s=args.stale_after_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s or None,
    )
    print(
        f"monitor: serving {args.db} on http://{args.host}:{port} (auth {'on' if token else 'off'})",
        flush=True,
    )
    print(f"monitor: dashboard http://{args.host}:{port}/", flush=True)
    # uvicorn shuts down on SIGTERM, then raises the signal again under the handler in place
    # before it: under the default one the process died there, before the database was closed,
    # and left its WAL (most of a run's records) beside it. Noted here, it ends as it should.
    stopped_by: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped_by.append(signum))
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        shots.close()
        store.close()
    return 128 + stopped_by[0] if stopped_by else 0


if __name__ == "__main__":
    sys.exit(main())
