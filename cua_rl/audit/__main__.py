"""``python -m cua_rl.audit --config FILE.yaml [key=value ...]`` (``cua_rl.audit.cli``)."""

from __future__ import annotations

import sys

from cua_rl.audit.cli import main

if __name__ == "__main__":
    sys.exit(main())
