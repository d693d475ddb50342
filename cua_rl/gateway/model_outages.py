"""The model-server outages a gateway is holding calls through, as the rollout sees them.

A call whose server refuses, drops or answers 5xx is held and re-sent (``engine``); while it is,
its server is out. ``Outages`` counts, per server, the calls held right now, from the first failed
send of a call until that call is answered, fails past ``gateway.model_outage_s`` or is
cancelled. The rollout side reads it before each new episode (``cua_rl.rollout.service_pauses``):
a server holding calls pauses new episodes instead of letting each one start and wait in its own
call.
Thread-safe: the gateway's loop writes, the rollout worker's loop reads. It logs one line when a
server goes out and one when it answers again, not one per call (hundreds of episodes share a
server).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from cua_rl.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class Held:
    """A server the gateway holds calls for: how many, since when (monotonic), the last error."""

    server: str
    calls: int
    since: float
    error: str


class Outages:
    """The held calls per server of one gateway (``Gateway.outages``; the rollout runtime hands
    its own to its gateway and reads it before each new episode)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, list] = {}  # server -> [calls, since, last error]

    def hold(self, server: str, error: str, outage_s: float) -> None:
        """A call's first failed send: it is held from now on."""
        with self._lock:
            entry = self._held.get(server)
            if entry is None:
                self._held[server] = [1, time.monotonic(), error]
            else:
                entry[0] += 1
                entry[2] = error
        if entry is None:
            log.warning(
                "model server %s unavailable (%s): calls are held and re-sent for up to "
                "gateway.model_outage_s=%g s",
                server,
                error,
                outage_s,
            )

    def failed_again(self, server: str, error: str) -> None:
        with self._lock:
            if server in self._held:
                self._held[server][2] = error

    def release(self, server: str, *, answered: bool) -> None:
        """A held call ended: answered (the server is back), failed or cancelled."""
        with self._lock:
            entry = self._held.get(server)
            if entry is None:
                return
            entry[0] -= 1
            ended = entry[0] <= 0 or answered
            if ended:
                del self._held[server]
        if ended and answered:
            log.warning(
                "model server %s answers again after an outage of %.1f s",
                server,
                time.monotonic() - entry[1],
            )

    def held(self, server: str | None = None) -> list[Held]:
        """The servers with calls held now (``server``: that one only)."""
        with self._lock:
            return [
                Held(s, calls, since, error)
                for s, (calls, since, error) in self._held.items()
                if server is None or s == server
            ]
