"""Dispatch ``python -m cua_rl.sim {gym,agent} ...`` to the stand-in's own ``main``."""

from __future__ import annotations

import sys

USAGE = "usage: python -m cua_rl.sim {gym,agent} [--help | options]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "gym":
        from cua_rl.sim.gym import main as run
    elif name == "agent":
        from cua_rl.sim.agent import main as run
    else:
        print(f"unknown stand-in {name!r}; {USAGE}", file=sys.stderr)
        return 2
    return run(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
