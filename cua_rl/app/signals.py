"""How a training stops: SIGTERM as Ctrl-C, and a systematic rejection as a failure.

AReaL stops its workers and inference servers on an interrupt (``KeyboardInterrupt``) but not on
SIGTERM, which batch schedulers send; and the fail-fast watch runs on a thread of its own while
the main thread is inside AReaL. Both therefore end the run the one way AReaL cleans up after:
an exception raised in the main thread where Ctrl-C's would be (``Terminated``,
``SystematicRejection``), from a signal handler. ``install`` sets the handlers.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from cua_rl.app.failfast import RejectionWatch, advice_for


class SystematicRejection(KeyboardInterrupt):
    """Every episode for failfast.persist_s was rejected for one reason: stopping is the only
    useful thing left. Raised where Ctrl-C would be, so AReaL stops its workers and servers the same way."""

    is_failure = True

    def __init__(self, reason: str, window: int, detail: str = ""):
        super().__init__(reason)
        self.reason, self.window, self.detail = reason, window, detail

    def __str__(self) -> str:
        advice = advice_for(self.reason, self.detail)
        return (
            f"the last {self.window} episodes, over at least failfast.persist_s, were all rejected "
            f"{self.reason!r}: {advice} (failfast.window=0 turns the check off)"
        )


_tripped: list[tuple[str, int, str]] = []


def stop_systematic(reason: str, window: int, detail: str = "") -> None:
    # Called on the watch's thread: the main thread is inside AReaL, so interrupt it the way
    # SIGTERM does; the handler raises there.
    _tripped.append((reason, window, detail))
    os.kill(os.getpid(), signal.SIGUSR1)


def _raise_systematic(signum: int, frame: Any) -> None:
    reason, window, detail = _tripped[-1] if _tripped else ("unknown", 0, "")
    raise SystematicRejection(reason, window, detail)


class stopping:
    def __init__(self, watch: RejectionWatch):
        self.watch = watch

    def __enter__(self):
        return self.watch

    def __exit__(self, *exc):
        self.watch.stop()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be: AReaL stops its workers and inference servers on
    an interrupt but not on SIGTERM, and a batch scheduler ends jobs with SIGTERM."""


def _terminate_like_ctrl_c(signum: int, frame: Any) -> None:
    # A second SIGTERM during the clean-up takes the default action: the operator insists.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated(signal.Signals(signum).name)


def install() -> None:
    """The launcher's handlers; call in the main thread before training."""
    signal.signal(signal.SIGTERM, _terminate_like_ctrl_c)
    signal.signal(signal.SIGUSR1, _raise_systematic)
    # A process started in the background by a non-interactive shell inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
