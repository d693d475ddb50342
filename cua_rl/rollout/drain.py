"""The end of a run: every episode still in flight is cancelled and closed within a bound.

AReaL ends a run (completion, failure, Ctrl-C, SIGTERM, a fail-fast stop) by destroying the rollout
engine on each worker, an RPC made before its scheduler signals the worker. Its task runner would
cancel its tasks and stop its loop as soon as they end, but a task is a *group* of episodes
(AReaL's ``GroupedRolloutWorkflow`` gathers them without ``return_exceptions``), and a cancelled
gather ends with its first cancelled child: the loop stopped while the siblings were still closing,
and their records were left open. So the runner's destroy first drains the runtime's episodes
itself: each rollout runtime owns one ``Drain`` and installs it on its engine's task runner
(``install``, on that runner alone), which pauses the runner, cancels every episode task
(``registered`` records them), waits for them within the bound, flushes the runtime's monitor
clients, and only then lets AReaL stop the loop.

A cancelled episode (``Drain.run``) runs its body as an inner task: the outer one starts the drain
clock, cancels the inner one, whose exits abandon the agent run and terminate the gym execution
(genv's shielded scope), waits for it at most until the deadline, marks the rollout cancelled
(``on_cancelled``, with ``DRAIN_REASON``) and flushes. A timer thread, independent of the event
loop, names what is still open at the deadline (rollout and execution ids: ``LiveEpisode``
observes the episode's box); the drain's last episode logs the summary. ``drain.timeout_s`` sets
the bound (docs/design.md, "The end of a run").
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from cua_rl.logs import get_logger
from cua_rl.rollout.episode import BoxChanged, EpisodeObserver
from cua_rl.rollout.settings import (  # noqa: F401  (DrainConfig: its documented home was here)
    AREAL_RUNNER_JOIN_S,
    LAST_FLUSH_S,
    MARGIN_S,
    DrainConfig,
)

log = get_logger(__name__)

# Why a drained episode's rollout and environment were closed (their status message).
DRAIN_REASON = "run ended: drained"


class LiveEpisode(EpisodeObserver):
    """What the drain names of an episode in flight: its rollout, and its gym execution once the
    box is open (it observes the episode's box for it). ``surplus``: a rollout the trainer
    prefetched after the last step, which the monitor does not record: the drain's summary
    counts those apart, as the monitor shows no cancelled rollout for them."""

    name = "drain"

    def __init__(self, rollout_uuid: str, surplus: bool = False):
        self.rollout_uuid = rollout_uuid
        self.surplus = surplus
        self.execution_id: str | None = None

    async def box_changed(self, event: BoxChanged) -> None:
        if event.box is not None:
            self.execution_id = event.box.execution_id


Flush = Callable[[float], Awaitable[bool]]


# The drain's line at a run's end with no episode to close. Each rollout worker (the eval one
# too) drains its own episodes and says what it closed: the demo shows the lines together.
NOTHING_IN_FLIGHT = "this rollout worker had no episode in flight at the run's end"


class Drain:
    """A runtime's episodes in flight, and the drain that closes them when the run ends.

    ``flush(timeout)`` stops the runtime's probes and flushes its monitor client on the running
    loop (False when it did not finish), after each cancelled episode; ``finish(timeout)`` does
    so once more and closes the loop's clients, before the runner stops the loop (their tasks
    would die with it); ``background()`` gives the gym client's terminates still running in the
    background on that loop."""

    def __init__(
        self,
        config: DrainConfig,
        *,
        flush: Flush,
        finish: Flush | None = None,
        background: Callable[[], Iterable[asyncio.Future]] = tuple,
    ) -> None:
        self.timeout_s = config.timeout_s
        self.flush = flush
        self.finish = finish or flush
        self.background = background
        self._lock = threading.Lock()
        self._open: dict[str, LiveEpisode] = {}  # by rollout uuid
        self._draining: dict[str, LiveEpisode] = {}  # those of them cancelled and not yet ended
        self._started: float | None = None
        self._deadline = 0.0
        self._cancelled = 0
        self._surplus = 0  # of them, rollouts prefetched after the last step (not recorded)
        self._unflushed: list[str] = []
        self._named = False
        self._timer: threading.Timer | None = None
        self._tasks: set[asyncio.Task] = set()  # the episode tasks running (``registered``)
        self.reports: list[str] = []  # the summary lines logged, for tests and callers

    def live(self, rollout_uuid: str, surplus: bool = False) -> LiveEpisode:
        """A new episode's record for this drain (it observes the episode's box)."""
        return LiveEpisode(rollout_uuid, surplus)

    def track(self, episode: LiveEpisode) -> None:
        with self._lock:
            self._open[episode.rollout_uuid] = episode

    def enter(self, task: asyncio.Task) -> None:
        with self._lock:
            self._tasks.add(task)

    def leave(self, task: asyncio.Task) -> None:
        with self._lock:
            self._tasks.discard(task)

    async def close(self) -> None:
        """Cancel every episode task of the running loop and wait for them within the bound.

        Rounds, because a group's gather starts its children a step after itself: a child that
        registers after a round is cancelled in the next one. Each task is cancelled once (a
        second cancel would cut its own drain short)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.timeout_s + LAST_FLUSH_S + MARGIN_S / 2
        cancelled: set[asyncio.Task] = set()
        while True:
            for _ in range(2):  # a task the runner just started, then the children it gathers
                await asyncio.sleep(0)
            with self._lock:
                new = [t for t in self._tasks if t.get_loop() is loop and t not in cancelled]
            new = [t for t in new if not t.done()]
            if not new:
                if not cancelled:
                    # Said too: a run's end shows the drain ran, whatever it found.
                    self.reports.append(NOTHING_IN_FLIGHT)
                    log.info(NOTHING_IN_FLIGHT)
                return
            for task in new:
                task.cancel()
            cancelled.update(new)
            left = [t for t in cancelled if not t.done()]
            if left and loop.time() < give_up:
                await asyncio.wait(left, timeout=give_up - loop.time())
            if loop.time() >= give_up:
                return  # what is still open was named at the deadline

    def begin(self, episode: LiveEpisode) -> float:
        """Count a cancelled episode in the drain, started by the first; its deadline."""
        timeout_s = self.timeout_s
        with self._lock:
            self._cancelled += 1
            self._surplus += episode.surplus
            self._draining[episode.rollout_uuid] = episode
            if self._started is None:
                self._started = time.monotonic()
                self._deadline = self._started + timeout_s
                self._timer = threading.Timer(timeout_s, self.overdue)
                self._timer.daemon = True
                self._timer.start()
                log.info(
                    "the run is ending; closing %d episodes in flight within %gs",
                    len(self._open),
                    timeout_s,
                )
            return self._deadline

    def remaining(self) -> float:
        return max(self._deadline - time.monotonic(), 0.0)

    def unflushed(self, rollout_uuid: str) -> None:
        with self._lock:
            self._unflushed.append(rollout_uuid)

    def done(self, episode: LiveEpisode) -> None:
        with self._lock:
            self._open.pop(episode.rollout_uuid, None)
            self._draining.pop(episode.rollout_uuid, None)
            if self._started is None or self._draining:
                return
            timer, self._timer = self._timer, None
            took = time.monotonic() - self._started
            if self._unflushed:
                line = (
                    f"{self._cancelled} episodes cancelled in {took:.1f}s; the monitor "
                    f"did not take the records of rollouts {sorted(self._unflushed)}"
                )
            else:
                line = f"{self._cancelled} episodes cancelled and closed in {took:.1f}s"
            if self._surplus:
                line += (
                    f" ({self._surplus} of them prefetched after the last step, which the "
                    "monitor does not record)"
                )
            self._reset()
        if timer is not None:
            timer.cancel()
        self.reports.append(line)
        (log.warning if "did not" in line else log.info)(line)

    def overdue(self) -> None:
        """Name what is still open (once per drain): at the deadline, from the first episode
        whose wait ended with its inner task pending, or from the timer if the loop is stuck."""
        with self._lock:
            left = self._draining
            if self._started is None or not left or self._named:
                return
            self._named = True
            rollouts = sorted(left)
            executions = sorted(str(e.execution_id) for e in left.values() if e.execution_id)
            took = time.monotonic() - self._started
        line = (
            f"left open after {took:.1f}s: rollouts {rollouts}, gym executions "
            f"{executions} (still closing; the gym's reaper ends what the worker cannot)"
        )
        self.reports.append(line)
        log.error(line)

    def _reset(self) -> None:
        self._started, self._cancelled, self._unflushed, self._named = None, 0, [], False
        self._surplus = 0

    # ---- the runner's destroy ---------------------------------------------------------------

    async def registered(self, start: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        """``await start()`` in a task the drain knows (``arun_episode``'s), for the run's end.
        A factory, not a coroutine: one closed before it started leaves nothing unawaited."""
        task = asyncio.current_task()
        self.enter(task)
        try:
            return await start()
        finally:
            self.leave(task)

    async def _drain_then_flush(self) -> None:
        await self.close()
        if not await self.finish(_PRE_FLUSH_S):
            log.warning("the monitor did not take every record before the run's end")

    def install(self, runner: Any) -> None:
        """Make ``runner.destroy`` (AReaL's ``AsyncTaskRunner`` of the engine's workflow executor)
        first drain these episodes and flush the monitor clients on the runner's loop. On this
        runner alone (an instance attribute): another training's runner is not touched.
        Idempotent."""
        original = runner.destroy
        if getattr(original, "_cua_drain", None) is self:
            return

        def destroy(*args, **kwargs):
            loop = runner._loop  # declared in cua_rl.areal.support
            if loop is not None and loop.is_running():
                runner.paused.set()  # no episode starts while the drain runs (destroy resumes it)
                done = asyncio.run_coroutine_threadsafe(self._drain_then_flush(), loop)
                try:
                    done.result(timeout=self.timeout_s + LAST_FLUSH_S + MARGIN_S + _PRE_FLUSH_S)
                except Exception as exc:  # a stuck loop must not stop the destroy
                    log.warning("draining the episodes before the run's end failed: %r", exc)
            return original(*args, **kwargs)

        destroy._cua_drain = self
        runner.destroy = destroy

    # ---- one cancelled episode ----------------------------------------------------------------

    async def run(
        self,
        body: Coroutine[Any, Any, Any],
        episode: LiveEpisode,
        on_cancelled: Callable[[], Awaitable[None]],
    ) -> Any:
        """``await body`` as an inner task; cancelled, close it within the drain (then re-raise).
        ``on_cancelled`` tells the monitor the rollout was cancelled."""
        inner = asyncio.ensure_future(body)
        self.track(episode)
        try:
            return await asyncio.shield(inner)
        except asyncio.CancelledError:
            self.begin(episode)
            inner.cancel()
            await self._settle(inner)
            if not inner.done():
                self.overdue()
            if not inner.done() or inner.cancelled():
                await on_cancelled()
            if not await self.flush(max(self.remaining(), LAST_FLUSH_S)):
                self.unflushed(episode.rollout_uuid)
            raise
        finally:
            if inner.done():
                if not inner.cancelled():
                    inner.exception()  # retrieved: an episode that failed as it was cancelled
                self.done(episode)
            else:  # past the deadline: named by the timer, off the list once it does end
                inner.add_done_callback(lambda _task: self.done(episode))

    async def _settle(self, inner: asyncio.Future) -> None:
        """Wait, within the drain, for the inner task and the gym's background terminates."""
        pending = {inner, *self.background()}
        while pending and self.remaining() > 0:
            try:
                _done, pending = await asyncio.wait(pending, timeout=self.remaining())
            except asyncio.CancelledError:
                continue  # a second cancel does not shorten the drain: its deadline does


# The last flush before a runner stops: the records of episodes that ended just before the
# end, and of those the drain closed, still sit in a client's queue, whose task dies with the loop.
_PRE_FLUSH_S = 5.0
