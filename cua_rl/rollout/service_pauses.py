"""A failing service pauses new episodes, not the training.

When an episode is rejected because the gym failed its create (5xx, refused, no answer), the agent
service failed to start its run, or the model server stayed out past ``gateway.model_outage_s``,
every episode started next would burn a box and a task on the same failure. A model server that
is out pauses new episodes before any is rejected: while the gateway holds calls for it
(``cua_rl.gateway.model_outages``), a new episode would only wait in its own call, so
``pause_for_held_calls`` opens the pause at the next episode's start. ``ServicePauses`` (the
rollout runtime keeps one per event loop) then holds each new episode at its start (``admit``, before it reads
the policy version, opens a gateway session or creates a box) and probes the failing service with
a growing, bounded backoff (``pause.probe_initial_s`` doubling up to ``pause.probe_max_s``); the
first probe that succeeds lets them all go. Episodes already in flight go on and are counted by
reason as before; a waiting episode is not rejected, so its task is not consumed and its group
stays whole. Each probe is what an episode would do first: the gym creates an execution of the
failed episode's task and terminates it, the agent service answers a run lookup, the model server
has no call held by the gateway any more and answers ``/health``.

The pauses observe the episodes themselves (``PauseObserver``, one per episode): whether the box
was created and whether the agent service answered its run's create tell a service's failure from
the episode's (``outage_of``), and a rejection that is the service's opens its pause.

A failed probe is appended to the worker's outcome file as a rejection for the episodes' reason,
so failfast (``cua_rl.app.failfast``) still stops a service that never comes back: its persistence
spans the probes. The monitor gets one ``pauses`` record per pause (service, reason, the last
error, start and end, failed probes), shown on the training's page (docs/monitor.md).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from cua_rl.aio import within
from cua_rl.core.reasons import Reason, agent_reason, gateway_reason
from cua_rl.errors import CuaRlError, GymError, ModelServerError, RejectedEpisode
from cua_rl.gateway.engine import server_url
from cua_rl.gateway.model_outages import Held, Outages
from cua_rl.logs import get_logger
from cua_rl.monitor.protocol import pause_client_id
from cua_rl.monitor.worker.batches import ref
from cua_rl.rollout.episode import AgentRan, BoxChanged, Ended, EpisodeObserver
from cua_rl.rollout.settings import PauseConfig

log = get_logger(__name__)

GYM, AGENT, MODEL_SERVER = "gym", "agent", "model_server"
MODEL_OUTAGE = gateway_reason("model_server_error")
AGENT_CREATE_FAILED = agent_reason("create_failed")

Probe = Callable[[], Awaitable[object]]


@dataclass(frozen=True)
class Outage:
    """A rejected episode's failure that is the service's, not the episode's."""

    service: str
    reason: str
    error: str


def outage_of(
    exc: RejectedEpisode, *, created: bool, agent_unavailable: bool = False
) -> Outage | None:
    """The service outage behind a rejection, or None when the episode itself failed.

    ``created``: the gym execution was created (a later gym failure is the execution's, not the
    service's); ``agent_unavailable``: the agent's run create failed with no answer or a 5xx."""
    cause = exc.__cause__
    if exc.reason == Reason.GYM_ERROR and not created and isinstance(cause, GymError):
        if cause.status is None or cause.status >= 500:
            return Outage(GYM, exc.reason, str(cause))
    if exc.reason == AGENT_CREATE_FAILED and agent_unavailable:
        return Outage(AGENT, exc.reason, exc.detail)
    if exc.reason == MODEL_OUTAGE:
        return Outage(MODEL_SERVER, exc.reason, exc.detail)
    return None


@dataclass
class Pause:
    service: str
    reason: str
    error: str
    phase: str
    started: float  # wall clock: the monitor and failfast compare workers' times
    probes: int = 0  # failed ones
    ended: float | None = None


class PauseRecords:
    """Where a pause is told: the log, the outcome file (failed probes, for failfast) and the
    monitor. ``outcome`` is ``OutcomeLog.record``; ``monitor`` returns the loop's client."""

    def __init__(self, training_ref: str, outcome=None, monitor=None):
        self.training_ref = training_ref
        self.outcome = outcome
        self.monitor = monitor
        self.worker = f"{socket.gethostname()}-{os.getpid()}"

    def opened(self, p: Pause) -> None:
        log.warning(
            "%s failing (%s: %s): new episodes wait and it is probed until it answers",
            p.service,
            p.reason,
            p.error[:300],
        )
        self._send(p)

    def probe_failed(self, p: Pause) -> None:
        if self.outcome is not None:
            self.outcome(accepted=False, reason=p.reason, phase=p.phase, probe=True)
        self._send(p)

    def closed(self, p: Pause) -> None:
        log.warning(
            "%s answers again after %.1f s (%d failed probes): episodes start again",
            p.service,
            p.ended - p.started,
            p.probes,
        )
        self._send(p)

    def _send(self, p: Pause) -> None:
        client = self.monitor() if self.monitor else None
        if client is None or not self.training_ref:
            return
        record = {
            "client_id": pause_client_id(self.training_ref, p.service, p.started, self.worker),
            **ref("training", self.training_ref),
            "service": p.service,
            "reason": p.reason,
            "error_message": p.error[:2000],
            "phase": p.phase,
            "worker": self.worker,
            "start_time": p.started,
            "probes": p.probes,
        }
        if p.ended is not None:
            record.update(end_time=p.ended, duration_s=round(p.ended - p.started, 3))
        client.enqueue("pauses", record)


@dataclass(frozen=True)
class ProbeTargets:
    """What one event loop's probes reach: its gym and agent clients (``gym()``, ``agent()``:
    made when a probe needs them), its plain HTTP client, the calls the gateway holds, and the
    model server the gateway is configured with (empty: the engine's, chosen for a probe)."""

    gym: Callable[[], Any]
    agent: Callable[[], Any]
    http: httpx.AsyncClient
    outages: Outages
    model_server: str = ""


class ServicePauses:
    """The open pauses of one event loop of a rollout runtime; see the module docstring.
    ``targets``: what its probes reach (a test that reports its own probes needs none)."""

    def __init__(
        self, config: PauseConfig, records: PauseRecords, targets: ProbeTargets | None = None
    ):
        self.config = config
        self.records = records
        self.targets = targets
        self.open: dict[str, Pause] = {}
        self._clear = asyncio.Event()
        self._clear.set()
        self._probers: set[asyncio.Task] = set()

    async def admit(self) -> float:
        """Wait while any service is paused; the seconds waited (0 when none was)."""
        if not self.open:
            return 0.0
        t0 = time.monotonic()
        while self.open:
            await self._clear.wait()
        return time.monotonic() - t0

    def report(self, outage: Outage, probe: Probe, *, phase: str) -> Pause | None:
        """Pause new episodes for ``outage`` unless its service is paused already."""
        if not self.config.enabled or outage.service in self.open:
            return None
        pause = Pause(outage.service, outage.reason, outage.error, phase, time.time())
        self.open[outage.service] = pause
        self._clear.clear()
        self.records.opened(pause)
        task = asyncio.get_running_loop().create_task(
            self._probe_until_up(pause, probe), name=f"probe-{outage.service}"
        )
        self._probers.add(task)
        task.add_done_callback(self._probers.discard)
        return pause

    def probe(self, service: str, task_id: str, choose_server: Callable[[], Any]) -> Probe:
        """The probe of ``service`` for an episode of ``task_id`` that failed on it."""
        t = self.targets
        if t is None:
            raise ValueError("these pauses were made without probe targets")
        server = t.model_server or (str(choose_server()) if service == MODEL_SERVER else "")
        return probe_for(
            service, self.config, genv=t.gym(), agent=t.agent(), http=t.http, task_id=task_id,
            model_server=server, outages=t.outages,
        )  # fmt: skip

    async def _probe_until_up(self, pause: Pause, probe: Probe) -> None:
        cfg, delay = self.config, self.config.probe_initial_s
        while True:
            await asyncio.sleep(delay)
            try:
                await probe()
                break
            except (CuaRlError, httpx.HTTPError, OSError, TimeoutError) as exc:
                pause.probes += 1
                pause.error = f"{type(exc).__name__}: {exc}"
                self.records.probe_failed(pause)
                delay = min(2 * delay, cfg.probe_max_s)
        pause.ended = time.time()
        del self.open[pause.service]
        if not self.open:
            self._clear.set()
        self.records.closed(pause)

    async def aclose(self) -> None:
        """Stop probing (the run ends; waiting episodes are the drain's to cancel)."""
        for task in list(self._probers):
            task.cancel()
        await asyncio.gather(*self._probers, return_exceptions=True)

    def pause_for_held_calls(self, outages: Outages, http, *, phase: str) -> None:
        """Before a new episode starts: when the gateway is holding calls because a model
        server is out (``outages``), pause new episodes (probed until the gateway's calls are
        answered and the server's ``/health`` answers) instead of starting one more that would
        wait in its own call."""
        for held in outages.held():
            if MODEL_SERVER in self.open:
                return
            probe = probe_for(
                MODEL_SERVER, self.config, genv=None, agent=None, http=http, task_id="",
                model_server=held.server, outages=outages,
            )  # fmt: skip
            self.report(Outage(MODEL_SERVER, MODEL_OUTAGE, held_error(held)), probe, phase=phase)


class PauseObserver(EpisodeObserver):
    """One episode seen by its loop's pauses: a rejection that is a service's failure (the gym's
    create, the agent service's, a model server out) pauses new episodes. ``choose_server``: the
    engine's, for a model server the gateway is not configured with."""

    name = "pauses"

    def __init__(
        self, pauses: ServicePauses, task_id: str, phase: str, choose_server: Callable[[], Any]
    ):
        self.pauses, self.task_id, self.phase = pauses, task_id, phase
        self.choose_server = choose_server
        self.created = self.agent_unavailable = False

    async def box_changed(self, event: BoxChanged) -> None:
        if event.box is not None:
            self.created = True

    async def agent_ran(self, event: AgentRan) -> None:
        self.agent_unavailable = bool(event.run.summary.create_unavailable)

    async def ended(self, event: Ended) -> None:
        if event.outcome != "rejected":
            return
        outage = outage_of(
            event.error, created=self.created, agent_unavailable=self.agent_unavailable
        )
        if outage is not None:
            probe = self.pauses.probe(outage.service, self.task_id, self.choose_server)
            self.pauses.report(outage, probe, phase=self.phase)


async def gym_probe(genv, task_id: str) -> None:
    """The gym creates an execution of ``task_id`` again; it is terminated at once."""
    async with genv.execution(task_id):
        pass


def held_error(held: Held) -> str:
    return (
        f"the gateway holds {held.calls} model call(s) for {held.server}, re-sending since "
        f"{time.monotonic() - held.since:.0f} s ago: {held.error}"
    )


async def model_server_probe(http: httpx.AsyncClient, server: str, outages: Outages) -> None:
    """Down while the gateway still holds calls for ``server`` (``outages``; it re-sends them
    itself: the first answered ends the outage); else vLLM and SGLang both answer
    ``GET /health`` with 200 once they serve."""
    for held in outages.held(server):
        raise ModelServerError(held_error(held))
    resp = await http.get(f"{server_url(server)}/health")
    if resp.status_code != 200:
        raise ModelServerError(
            f"model server {server} /health answered {resp.status_code}", status=resp.status_code
        )


def probe_for(
    service: str,
    config: PauseConfig,
    *,
    genv,
    agent,
    http,
    task_id: str,
    model_server: str,
    outages: Outages,
) -> Probe:
    """The probe of ``service``: what an episode would ask of it first, bounded."""
    if service == GYM:
        return lambda: gym_probe(genv, task_id)  # the gym client's own timeouts bound it
    if service == AGENT:
        return lambda: within(config.probe_timeout_s, agent.probe())
    return lambda: within(config.probe_timeout_s, model_server_probe(http, model_server, outages))
