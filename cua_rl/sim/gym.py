"""A local gym server that speaks the genv protocol over a pluggable device.

``python -m cua_rl.sim gym --host 127.0.0.1 --port N [--gym-id sim] [--backend phone|browser]``
serves the genv endpoints (docs/design.md: same paths, bodies and answer shapes) plus the
sim-only endpoints documented in docs/conventions.md (screenshots, actions, execution listing,
fault injection, health). ``gym_state`` holds the state, ``gym_app`` the HTTP side; this module
runs them and re-exports what callers import (``SimGymConfig``, ``Fault``, ``GymServer``).

Design:
- ``SimGym`` owns what every execution has in common: live executions, each with the device
  its backend opened (``cua_rl/sim/device.py``: the simulated phone, or a MiniWoB page in a
  headless Chromium), screenshots kept after terminate for a bounded retention (they stand in
  for presigned object-store URLs), a cap on live executions and a sweeper that expires idle
  ones (the only cleanup a real gym has for an execution whose creator vanished). A terminated
  execution's screenshots are kept on disk (``cua_rl.core.spill``), so retention costs no memory. A
  device that breaks fails its execution only; stopping the gym closes every execution still
  open.
- Faults are injected per operation (create / evaluate / terminate): latency first, then a 500
  with ``detail``, then the real work, then optionally a dropped connection. Dropping *after*
  the work is the worst case on purpose: a dropped create leaves a live execution the client
  never heard of, exactly the leak the client and the idle expiry must cope with.
- ``GymServer`` runs the app with uvicorn in a thread on a free loopback port for tests and
  demos; ``main`` runs it in the foreground and prints one ``ready`` line with the base URL.
"""

from __future__ import annotations

import argparse
import sys

from cua_rl.errors import ConfigError
from cua_rl.serving import ThreadedServer
from cua_rl.sim.browser import BrowserConfig
from cua_rl.sim.device import BACKENDS
from cua_rl.sim.gym_app import create_app
from cua_rl.sim.gym_state import OPS, Execution, Fault, SimGym, SimGymConfig

__all__ = ["OPS", "Execution", "Fault", "GymServer", "SimGym", "SimGymConfig", "main"]


class GymServer(ThreadedServer):
    """The sim gym on a free loopback port in a background thread: ``with GymServer() as g``."""

    def __init__(
        self,
        config: SimGymConfig | None = None,
        host: str = "127.0.0.1",
        log_level: str = "warning",
        port: int = 0,
    ):
        self.gym = SimGym(config)
        super().__init__(
            create_app(self.gym), host=host, port=port, name="sim-gym", log_level=log_level
        )

    @property
    def gym_id(self) -> str:
        return self.gym.config.gym_id

    @property
    def base_url(self) -> str:
        return f"{self.url}/api/v1/{self.gym_id}"

    def start(self, timeout: float = 20.0) -> GymServer:
        super().start(timeout)
        return self


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cua_rl.sim gym",
        description="Local genv-compatible gym over a simulated phone.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port", type=int, default=8800, help="0 picks a free port (printed on the ready line)"
    )
    p.add_argument("--gym-id", default="sim")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-live", type=int, default=256)
    p.add_argument(
        "--idle-ttl", type=float, default=900.0, help="seconds before an idle execution expires"
    )
    p.add_argument(
        "--screenshot-retention",
        type=float,
        default=3600.0,
        help="seconds screenshots stay fetchable after terminate",
    )
    p.add_argument(
        "--screenshot-spill-dir",
        default="",
        help="where terminated executions' screenshots are kept on disk (default: the temp dir)",
    )
    p.add_argument(
        "--clock",
        default="fixed",
        choices=("fixed", "ticking"),
        help="phone: the status bar's clock, fixed at 12:00 or a minute later per action",
    )
    p.add_argument("--width", type=int, default=360)
    p.add_argument("--height", type=int, default=640)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--backend", default="phone", choices=BACKENDS)
    p.add_argument(
        "--task-file",
        action="append",
        default=[],
        metavar="FILE",
        help="phone: a YAML file of tasks served beside the built-in ones (repeatable; "
        "docs/gym.md, 'Tasks of your own')",
    )
    p.add_argument(
        "--tasks", default="", help="browser: comma-separated MiniWoB task names (default: all)"
    )
    p.add_argument("--scale", type=float, default=2.0, help="browser: pixels per CSS pixel")
    p.add_argument("--reward", default="raw", help="browser: raw | discounted | binary")
    p.add_argument(
        "--episode-max-time", type=float, default=600.0, help="browser: MiniWoB's timer, seconds"
    )
    for op in OPS:
        p.add_argument(f"--{op}-fail-rate", type=float, default=0.0)
        p.add_argument(f"--{op}-latency", type=float, default=0.0, help="seconds")
        p.add_argument(f"--{op}-drop-rate", type=float, default=0.0)
    return p


def config_of(args: argparse.Namespace) -> SimGymConfig:
    """The command line's ``SimGymConfig`` (a ``ConfigError`` names what is wrong)."""
    faults = {}
    for op in OPS:
        f = {
            k: getattr(args, f"{op}_{a}")
            for k, a in (
                ("fail_rate", "fail_rate"),
                ("latency_s", "latency"),
                ("drop_rate", "drop_rate"),
            )
        }
        if any(f.values()):
            faults[op] = f
    return SimGymConfig(
        gym_id=args.gym_id,
        seed=args.seed,
        max_live=args.max_live,
        idle_ttl_s=args.idle_ttl,
        screenshot_retention_s=args.screenshot_retention,
        screenshot_spill_dir=args.screenshot_spill_dir,
        width=args.width,
        height=args.height,
        clock=args.clock,
        faults=faults,
        backend=args.backend,
        task_files=args.task_file,
        browser=BrowserConfig(
            scale=args.scale,
            tasks=[t for t in args.tasks.split(",") if t],
            reward=args.reward,
            episode_max_time_s=args.episode_max_time,
        ),
    )


def parse_config(argv: list[str]) -> tuple[argparse.Namespace, SimGymConfig]:
    """``python -m cua_rl.sim gym``'s arguments and the config they give."""
    args = _parser().parse_args(argv)
    return args, config_of(args)


def main(argv: list[str] | None = None) -> int:
    try:
        args, cfg = parse_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        server = GymServer(cfg, host=args.host, port=args.port, log_level=args.log_level)
    except ConfigError as e:  # a task file's mistake, a missing browser
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    return server.serve_until_interrupted(ready=f"ready {server.base_url}")
