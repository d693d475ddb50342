"""How long a call may wait for a paused rollout: a bound derived from the pauses of this run.

AReaL 1.0.4 tells a rollout worker nothing about a weight update that failed: the trainer's
``actor.update_weights`` raises on the trainer's side and the run ends (its ``close`` destroys
every rollout engine, and the drain closes each episode's gateway session), while an update that
hangs (a stuck broadcast, a server that never loads) leaves the rollout paused with no end. So
the gateway measures the pauses it waits through, per engine: a pause starts when the first
call finds the engine paused and ends when a waiting call finds it running again. Until a pause
has ended, the bound is ``gateway.max_pause_wait_s``; after, ``pause_wait_factor`` times the
longest pause measured, at least ``min_pause_wait_s`` and at most ``max_pause_wait_s``. Every call
waiting in a pause older than its bound fails with ``pause_timeout`` and the reason, at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PauseBound:
    """The bound's settings (``GatewayConfig``'s ``max_pause_wait_s``, ``pause_wait_factor``,
    ``min_pause_wait_s``)."""

    first_s: float
    factor: float
    floor_s: float

    def of(self, longest_s: float | None) -> tuple[float, str]:
        """The bound given the longest pause measured (None: none yet) and how it was derived."""
        if longest_s is None:
            return self.first_s, (
                f"gateway.max_pause_wait_s={self.first_s:g} (no pause of this run has ended yet)"
            )
        derived = min(max(self.factor * longest_s, self.floor_s), self.first_s)
        return derived, (
            f"{derived:g} s: gateway.pause_wait_factor={self.factor:g} x the longest pause this "
            f"run has had ({longest_s:.1f} s), at least gateway.min_pause_wait_s="
            f"{self.floor_s:g} and at most gateway.max_pause_wait_s={self.first_s:g}"
        )


class WeightPauses:
    """The pauses of one rollout engine, as the gateway's waiting calls see them (thread-safe:
    the gateway's loop and the rollout worker's read and write it). One per engine: the rollout
    runtime bound to it owns it (``cua_rl.rollout.runtime``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self.started: float | None = None  # when a call first found the current pause
        self.longest_s: float | None = None  # the longest pause that ended
        self.ended = 0  # pauses measured

    def paused_for(self) -> float:
        """A call found the engine paused: how long the pause has lasted."""
        now = self.clock()
        with self._lock:
            if self.started is None:
                self.started = now
            return now - self.started

    def running(self) -> None:
        """A call found the engine running: the pause in progress (if any) ended now."""
        now = self.clock()
        with self._lock:
            if self.started is None:
                return
            length, self.started = now - self.started, None
            self.longest_s = length if self.longest_s is None else max(self.longest_s, length)
            self.ended += 1
