"""Fixtures shared by the launcher's tests."""

from __future__ import annotations

import pytest

from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.serving import ThreadedServer


@pytest.fixture
def monitor(tmp_path):
    """A real monitor on loopback over a temp SQLite file; ``db_path`` names the file."""
    store = MonitorStore(str(tmp_path / "m.db"))
    with ThreadedServer(create_app(store)) as server:
        server.db_path = tmp_path / "m.db"
        yield server
    store.close()
