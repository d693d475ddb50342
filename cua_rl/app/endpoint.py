"""The monitor a training writes to: the configured URL, or an embedded server on a SQLite file."""

from __future__ import annotations

from pathlib import Path

from cua_rl.app.config import CUAConfig
from cua_rl.logs import get_logger

log = get_logger(__name__)


class MonitorEndpoint:
    """The monitor URL for this run: the configured one, or an embedded server on a SQLite file."""

    def __init__(self, config: CUAConfig):
        self.config = config
        self.server = None
        self.store = None
        self.url = ""
        self.token = ""  # the project token (MonitorSection.resolved)

    def __enter__(self) -> MonitorEndpoint:
        m = self.config.monitor
        if not m.enabled:
            return self
        self.url, self.token = m.resolved()
        if not self.url and m.db_path:
            from cua_rl.monitor.server.app import create_app
            from cua_rl.monitor.server.store import MonitorStore
            from cua_rl.serving import ThreadedServer

            Path(m.db_path).parent.mkdir(parents=True, exist_ok=True)
            self.store = MonitorStore(m.db_path)
            self.server = ThreadedServer(
                create_app(self.store, token=self.token or None), name="monitor"
            ).start()
            self.url = self.server.url
            log.info("embedded monitor on %s, database %s", self.url, m.db_path)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()
        if self.store is not None:
            self.store.close()

    def client_config(self, spool_dir: Path):
        if not self.url:
            return None
        from cua_rl.monitor.worker.client import MonitorClientConfig

        m = self.config.monitor
        return MonitorClientConfig(
            base_url=self.url,
            token=self.token,  # "" is no token: the client reads no environment for it
            spool_path=m.spool_path or str(spool_dir / "monitor-spool.jsonl"),
        )
