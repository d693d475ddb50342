"""Each rollout worker's episode outcomes, appended to a file of its own.

The controller's failfast watch (``cua_rl.app.failfast.RejectionWatch``) reads these files; the
folder is on the file system AReaL already shares between nodes, and one writer per file needs
no locking.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from cua_rl.logs import get_logger

log = get_logger(__name__)

# The longest detail an outcome line keeps: failfast's line quotes it.
DETAIL_CHARS = 300


class OutcomeLog:
    """Append-only outcome lines of one worker process (one writer per file: no locking)."""

    def __init__(self, directory: str | os.PathLike, clock=time.time):
        self.directory = Path(directory)
        self.clock = clock  # wall clock: the controller compares times of several workers
        self.path = self.directory / f"outcomes-{socket.gethostname()}-{os.getpid()}.jsonl"

    def record(
        self,
        *,
        accepted: bool,
        reason: str | None,
        phase: str,
        probe: bool = False,
        detail: str = "",
    ) -> None:
        """One episode's outcome; ``probe``: a failed probe of a paused service
        (``cua_rl.rollout.service_pauses``), which failfast counts as a rejection for ``reason``;
        ``detail``: what failfast's line names beside the reason (a hook's exception)."""
        rec = {"t": self.clock(), "ok": accepted, "reason": reason, "phase": phase}
        if probe:
            rec["probe"] = True
        if detail:
            rec["detail"] = detail[:DETAIL_CHARS]
        line = json.dumps(rec)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as exc:  # the watch is a safeguard; never fail an episode over it
            log.warning("cannot append to %s: %s", self.path, exc)
