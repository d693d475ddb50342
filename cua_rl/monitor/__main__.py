"""``python -m cua_rl.monitor serve --db PATH [--host H] [--port N] [--token T]``.

The token also comes from ``MONITOR_PROJECT_TOKEN``; without one the API is open (loopback use).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from cua_rl.monitor.app import DEFAULT_MAX_BODY_BYTES

USAGE = "usage: python -m cua_rl.monitor serve --db PATH [--host H] [--port N] [--token T]"


def main(argv: list[str] | None = None) -> int:
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
    serve.add_argument("--log-level", default="warning", help="uvicorn log level")
    args = parser.parse_args(argv)

    if args.max_body_bytes < 1024:
        parser.error("--max-body-bytes must be at least 1024")
    import uvicorn

    from cua_rl.monitor.app import create_app
    from cua_rl.monitor.store import MonitorStore

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    token = args.token or os.environ.get("MONITOR_PROJECT_TOKEN") or None
    store = MonitorStore(args.db)
    app = create_app(store, token=token, max_body_bytes=args.max_body_bytes)
    print(
        f"monitor: serving {args.db} on http://{args.host}:{args.port} "
        f"(auth {'on' if token else 'off'})",
        flush=True,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
