"""Stop a training whose episodes are all rejected for one reason, instead of spinning forever.

A step only ends when it has enough accepted rows, so a configuration that rejects every
episode (the agent returns no token data, the gym refuses every create, the gateway is out of
the agent's reach) keeps the trainer rolling out until someone stops it. Rollout workers append
each episode's outcome to a file of their own under the run's log folder (``OutcomeLog``; the
folder is on the file system AReaL already shares between nodes); the controller watches those
files (``RejectionWatch``) and, when one reason has rejected every episode for ``persist_s``
(the span of the rejections' own times) and at least ``window`` episodes with none accepted,
calls back with that reason, which ``train.py`` turns into a failed training with advice.
Persistence, not a count: the episodes in flight (64 to 512 in production) are all rejected
within seconds of any outage, a model-server restart or a gym deploy, which must not end a run.
While a service fails, new episodes wait (``cua_rl.rollout.service_pauses``) and the worker
appends each failed probe of it as a rejection for the same reason, so the streak goes on through
the pause and a service that never comes back still stops the run within ``persist_s``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cua_rl.core.fields import doc
from cua_rl.core.reasons import AGENT_PREFIX, HOOK_PREFIX, Reason, gateway_reason
from cua_rl.errors import ConfigError
from cua_rl.logs import get_logger

log = get_logger(__name__)

_IMAGE_HOSTS = (
    "the screenshots come from a host that is not allowed: add it to "
    "trajectory.allowed_image_hosts (and agent.screenshot_hosts)"
)
# What to do about the rejection reasons a misconfiguration causes; others get the generic line.
ADVICE = {
    Reason.MISSING_TOKENS: "the agent's model outputs carry no token ids or logprobs: use "
    "endpoint.mode=gateway (the default), or patch the agent and set agent.model_options.logprobs=true",
    Reason.GATEWAY_UNREACHABLE: "the agent cannot reach the rollout gateway: set gateway.bind_host "
    "(0.0.0.0 when the agent runs on another machine) and gateway.public_host to an address "
    "the agent's machine can reach",
    Reason.GYM_ERROR: "the gym server fails every execution: check gym.base_url, gym.gym_id and the "
    "gym's own logs (python -m examples.cua_agent.train --check tests the services)",
    Reason.IMAGE_URL_REFUSED: _IMAGE_HOSTS,
    gateway_reason(Reason.IMAGE_URL_REFUSED): _IMAGE_HOSTS,
    gateway_reason(
        "sampling_mismatch"
    ): "the agent asks for sampling settings other than the trainer's "
    "and gateway.sampling_mismatch=error: align the agent or set it to override",
    Reason.PREFIX_BREAK: "every episode breaks the multi-turn prefix: use endpoint.mode=gateway, or "
    "trajectory.prefix_break_policy=rows (a row per run of consistent calls)",
}


def advice_for(reason: str, detail: str = "") -> str:
    """What to do about ``reason``; ``detail``: the latest rejection's, which a hook's names (the
    exception and the hook that raised it)."""
    if reason in ADVICE:
        return ADVICE[reason]
    if reason.startswith(HOOK_PREFIX):
        hook = reason.removeprefix(HOOK_PREFIX)
        raised = f": {detail}" if detail else ""
        return (
            f"the workflow's {hook} hook raised on every episode{raised}. Fix the hook (its "
            "traceback is in the rollout log, logs/rollout*.log) or leave it to the library's"
        )
    if reason.startswith(AGENT_PREFIX):
        return (
            f"every agent run ends {reason.removeprefix(AGENT_PREFIX)!r}: read the agent's log and the "
            "rollout log (logs/rollout*.log) for its error events"
        )
    return "read the rollout log (logs/rollout*.log) for the episodes' errors"


# Below this, failfast.persist_s is a burst detector: one blip of a service rejects every
# episode in flight at once.
MIN_PERSIST_S = 60.0


@dataclass
class FailFastConfig:
    window: int = doc(
        32,
        (
            "Fewest consecutive episodes rejected for one reason before the training may be "
            "stopped as failed (with failfast.persist_s); 0 turns the check off."
        ),
    )
    persist_s: float = doc(
        600.0,
        (
            "Stop only when one reason has rejected every episode for this long (from the "
            "first to the latest rejection, none accepted between). The default outlasts a "
            "model-server restart or a service deploy, and still stops a configuration that "
            "can never work within 10 minutes."
        ),
    )
    poll_s: float = doc(2.0, "How often the controller reads the outcome files (s).")

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ConfigError("failfast.window must be >= 0 (0 turns the check off)")
        if self.persist_s < 0:
            raise ConfigError("failfast.persist_s must be >= 0 seconds, e.g. 600")
        if self.poll_s <= 0:
            raise ConfigError("failfast.poll_s must be positive (seconds)")

    def check_concurrency(self, in_flight: int | None) -> None:
        """Refuse a check that the episodes in flight during one blip would trip at once."""
        if not self.window or self.persist_s >= MIN_PERSIST_S:
            return
        if in_flight and self.window > in_flight:
            return
        concurrency = in_flight or "unbounded"
        raise ConfigError(
            f"failfast.persist_s={self.persist_s:g} with failfast.window={self.window} and "
            f"rollout.max_concurrent_rollouts={concurrency}: the episodes in flight during a "
            "service blip of a few seconds would all be rejected at once and stop the training. "
            f"Set failfast.persist_s to at least {MIN_PERSIST_S:g} (default 600), or "
            f"failfast.window above rollout.max_concurrent_rollouts"
        )


@dataclass
class Streak:
    """The current run of rejections for one reason, none accepted since it began."""

    reason: str | None = None
    count: int = 0
    first_t: float = 0.0
    last_t: float = 0.0
    detail: str = ""  # the latest rejection's, when its worker wrote one

    def add(self, t: float, ok: bool, reason: str | None, detail: str = "") -> None:
        if ok:
            self.reason, self.count, self.detail = None, 0, ""
        elif self.count and reason == self.reason:
            self.count, self.last_t = self.count + 1, max(self.last_t, t)
            self.detail = detail or self.detail
        else:
            self.reason, self.count, self.first_t, self.last_t = reason, 1, t, t
            self.detail = detail

    def persistent(self, window: int, persist_s: float) -> str | None:
        """The reason, once it rejected ``window`` episodes in a row over ``persist_s``."""
        if window <= 0 or self.count < window or self.last_t - self.first_t < persist_s:
            return None
        return self.reason or "rejected"


class RejectionWatch:
    """Controller side: a thread that tails every worker's outcome file. ``on_trip(reason,
    count, detail)``: the reason that tripped, its streak's length and its latest detail."""

    def __init__(
        self,
        directory: str | os.PathLike,
        config: FailFastConfig,
        on_trip: Callable[[str, int, str], None],
    ):
        self.directory = Path(directory)
        self.config = config
        self.on_trip = on_trip
        self.streak = Streak()
        self._offsets: dict[Path, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tripped: str | None = None

    def start(self) -> RejectionWatch:
        if self.config.window > 0:
            self._thread = threading.Thread(target=self._loop, name="rejection-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _loop(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            reason = self.poll()
            if reason is not None:
                self.tripped = reason
                self.on_trip(reason, self.streak.count, self.streak.detail)
                return

    def poll(self) -> str | None:
        """Read what was appended since the last poll; the tripping reason, if any."""
        fresh: list[tuple[float, bool, str | None, str]] = []
        for path in sorted(self.directory.glob("outcomes-*.jsonl")):
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    chunk = f.read()
            except OSError:
                continue
            # Only whole lines: a writer may be half way through the last one.
            whole = chunk[: chunk.rfind(b"\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(whole)
            for line in whole.decode("utf-8", errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                    detail = str(rec.get("detail") or "")
                    fresh.append((float(rec["t"]), bool(rec["ok"]), rec.get("reason"), detail))
                except (ValueError, KeyError, TypeError):
                    continue
        for item in sorted(fresh):
            self.streak.add(*item)
        return self.streak.persistent(self.config.window, self.config.persist_s)
