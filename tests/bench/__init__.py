"""Tests of the benches' arithmetic; ``load_bench`` imports a script of bench/ by its path,
``training_db`` starts a monitor database by hand."""

from __future__ import annotations

import importlib.util
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cua_rl.monitor.server.store import MonitorStore

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


def training_db(path: Path, status: str) -> sqlite3.Connection:
    """A migrated monitor database holding training 1 (``status``) and task 1, open for plain
    SQL inserts at hand-picked values."""
    MonitorStore(path).close()
    db = sqlite3.connect(path)
    db.execute("INSERT INTO training (id, run_name, log_path, model_name, status) "
               "VALUES (1, 'r', 'l', 'm', ?)", (status,))  # fmt: skip
    db.execute("INSERT INTO task (id, task_id, name, description) VALUES (1, 't', 't', '')")
    return db
