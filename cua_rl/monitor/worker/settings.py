"""The monitor client's settings (``MonitorClientConfig``) and its counters.

Every field is documented and checked in ``__post_init__``; ``MONITOR_BASE_URL`` and
``MONITOR_PROJECT_TOKEN`` fill the URL and the token when they are not given.
"""

from __future__ import annotations

import collections
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError


@dataclass
class MonitorClientConfig:
    base_url: str = doc(
        "", "Monitor base URL, e.g. http://127.0.0.1:8765 (default: $MONITOR_BASE_URL)"
    )
    token: str | None = doc(None, "Project token sent as Bearer (default: $MONITOR_PROJECT_TOKEN)")
    batch_max_records: int = doc(500, "Most records in one POST; larger queues are split")
    flush_interval_s: float = doc(
        0.25, "Longest a record waits in the queue before a (partial) batch is sent"
    )
    max_queue_records: int = doc(
        200_000, "Records held in memory; beyond this new records are dropped and counted"
    )
    request_timeout_s: float = doc(10.0, "Timeout of one POST")
    max_retries: int = doc(3, "Retries of one batch before it is spooled")
    backoff_initial_s: float = doc(0.2, "First retry delay")
    backoff_max_s: float = doc(5.0, "Largest retry delay")
    replay_interval_s: float = doc(
        2.0, "How often a non-empty spool is retried while the monitor is unreachable"
    )
    reference_wait_s: float = doc(
        600.0,
        (
            "How long a batch whose record names a training, step, eval or baseline the "
            "monitor does not have yet waits in the spool for it (the trainer, another "
            "process, sends those; after a monitor restart it may replay later); then the "
            "record is dropped and counted"
        ),
    )
    spool_path: str | None = doc(
        None,
        (
            "JSONL spool for batches the monitor could not take; replayed later, also by a "
            "new client on the same path (default: a per-process file in the temp dir)"
        ),
    )

    max_screenshot_queue_bytes: int = doc(
        64 * 1024 * 1024,
        (
            "Bytes of screenshots waiting for upload; beyond this new ones are dropped "
            "and counted (the observation keeps its reference)"
        ),
    )

    def __post_init__(self):
        # Clients read these from the environment when not configured.
        self.base_url = self.base_url or os.environ.get("MONITOR_BASE_URL", "")
        if self.token is None:
            self.token = os.environ.get("MONITOR_PROJECT_TOKEN") or None
        if not self.base_url or not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"monitor base_url must be an http(s) URL, got {self.base_url!r}; set "
                "MONITOR_BASE_URL or pass base_url"
            )
        self.base_url = self.base_url.rstrip("/")
        for name in ("batch_max_records", "max_queue_records", "max_screenshot_queue_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"monitor {name} must be >= 1, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ConfigError(f"monitor max_retries must be >= 0, got {self.max_retries}")
        for name in (
            "flush_interval_s",
            "request_timeout_s",
            "backoff_initial_s",
            "backoff_max_s",
            "replay_interval_s",
            "reference_wait_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"monitor {name} must be > 0, got {getattr(self, name)}")
        if self.spool_path is None:
            self.spool_path = os.path.join(
                tempfile.gettempdir(), f"cua-rl-monitor-spool-{os.getpid()}.jsonl"
            )

    @classmethod
    def from_env(cls, **overrides: Any) -> MonitorClientConfig:
        overrides.setdefault("base_url", os.environ.get("MONITOR_BASE_URL", ""))
        overrides.setdefault("token", os.environ.get("MONITOR_PROJECT_TOKEN") or None)
        return cls(**overrides)


@dataclass
class MonitorCounters:
    sent: int = 0
    retried: int = 0
    spooled: int = 0
    replayed: int = 0
    dropped: int = 0
    waited: int = 0  # refusals for a training/step/eval/baseline not recorded yet (retried)
    # Records the server refused (422) and the client dropped, by ``kind.field``.
    refused: collections.Counter = field(default_factory=collections.Counter)
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "refused": dict(self.refused)}
