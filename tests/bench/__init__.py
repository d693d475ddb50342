"""Tests of the benches' arithmetic; ``load_bench`` imports a script of bench/ by its path."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def load_bench(name: str) -> Iterator:
    """bench/<name>.py as a module, registered under ``name`` while in use (dataclasses resolve
    their annotations through sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
