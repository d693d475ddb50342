"""One rollout worker's runtime: everything its episodes share, built in one place.

AReaL builds a new workflow for every group it submits (from the dotted path and keyword
arguments the trainer gives it) and hands each episode its worker's inference engine, so what a
worker's episodes share can live neither in the workflow nor in module globals (two trainings in
one process would share those, and tests would reset them). It lives in one ``RolloutRuntime``,
built on the engine's first episode (``RolloutRuntime.of``) and kept on that engine; a test
builds its own and passes it to the workflow. It owns:

- the gateway (started on first use), the model-server outages it holds calls through and the
  engine's weight-update pauses (``cua_rl.gateway``);
- the service clients (``ServiceClients``: gym, agent service or built-in agent loop, monitor)
  and, with ``agent.mode: function``, the user's agent function, imported once,
  per event loop: httpx clients are bound to the loop they were made on, and AReaL may run
  episodes on a new loop after a restart;
- the service pauses, per event loop (``service_pauses``: new episodes wait while a service
  fails) and the outcome file failfast reads;
- the drain (``drain``), installed on the engine's task runner: what closes the episodes in
  flight when the run ends;
- the replay pool and the group filter with its settings (``groups``), which AReaL calls with a
  group's rows in the context the workflow puts it in (``enter_group``).

The settings that make a runtime (services, gateway, pauses, drain, groups: ``runtime_key``) must
be the same for every workflow on one engine (a worker's eval and baseline passes are); a
workflow whose differ is refused rather than given another's.
"""

from __future__ import annotations

import asyncio
import atexit
import weakref
from collections.abc import Callable
from typing import Any

import httpx

from cua_rl.agent.builtin import run_builtin
from cua_rl.agent.function import AgentTask, FunctionRun, load_agent_function, run_function
from cua_rl.agent.loop import AgentLoop, LoopConfig
from cua_rl.agent.service_driver import RunDriver
from cua_rl.agent.spec import RunResult, RunSpec
from cua_rl.clients.gbox_mini_agent import MiniAgentClient
from cua_rl.clients.genv import GenvClient
from cua_rl.errors import ConfigError, RejectedEpisode
from cua_rl.gateway import AReaLEngineView, Gateway, SessionSpec
from cua_rl.gateway.model_outages import Outages
from cua_rl.gateway.weight_pauses import WeightPauses
from cua_rl.logs import get_logger
from cua_rl.monitor.worker.client import MonitorClient, MonitorClientConfig
from cua_rl.rollout import groups
from cua_rl.rollout.drain import Drain
from cua_rl.rollout.episode import EpisodeTask, ModelEndpoint
from cua_rl.rollout.outcomes import OutcomeLog
from cua_rl.rollout.service_pauses import (
    MODEL_SERVER,
    PauseRecords,
    ServicePauses,
    outage_of,
    probe_for,
)
from cua_rl.rollout.settings import WorkflowSettings
from cua_rl.warehouse.replay import ReplayPool

log = get_logger(__name__)

# Where the runtime of an engine is kept: an attribute of the engine AReaL hands every episode.
ENGINE_ATTRIBUTE = "cua_rl_runtime"


def runtime_key(s: WorkflowSettings) -> str:
    """The settings a runtime is made of (the rest is per episode: phase, sampling, rows...)."""
    monitor = (s.monitor_base_url, s.monitor_token, s.monitor_spool_path)
    agent = (s.agent.mode, s.agent.base_url, s.agent.builtin, s.agent.driver, s.agent.function)
    return repr(
        (s.gym.base_url, s.gym.gym_id, s.gym.timeouts, agent, monitor, s.gateway, s.pause)
        + (s.drain, s.group, s.outcome_dir, s.training_ref)
    )


class ServiceClients:
    """The gym, agent and monitor clients of a runtime, made lazily per event loop. In
    ``agent.mode: builtin`` there is no agent service: ``agent()`` is None and ``agent_loop``
    gives the loop's ``AgentLoop`` instead."""

    def __init__(self, s: WorkflowSettings):
        self._gym = (s.gym.base_url, s.gym.gym_id, s.gym.timeouts)
        self._agent_url = s.agent.base_url if s.agent.mode == "service" else ""
        self._monitor_config = None
        if s.monitor_base_url:
            self._monitor_config = MonitorClientConfig(
                base_url=s.monitor_base_url,
                # Resolved by the launcher (MonitorSection.resolved): "" is no token, and the
                # worker's own environment is not read for one.
                token=s.monitor_token,
                spool_path=s.monitor_spool_path or None,
            )
        # Keyed by the loop itself, weakly: a loop's id can be reused once it is gone.
        self._per_loop: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop,
            tuple[GenvClient, MiniAgentClient | None, httpx.AsyncClient],
        ] = weakref.WeakKeyDictionary()
        self._agent_loops: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[str, AgentLoop]
        ] = weakref.WeakKeyDictionary()
        self._monitors: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, MonitorClient] = (
            weakref.WeakKeyDictionary()
        )

    def _clients(self) -> tuple[GenvClient, MiniAgentClient | None, httpx.AsyncClient]:
        loop = asyncio.get_running_loop()
        if loop not in self._per_loop:
            base, gym_id, timeouts = self._gym
            http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0))
            genv = GenvClient(base, gym_id, client=http, timeouts=timeouts)
            agent = MiniAgentClient(self._agent_url, client=http) if self._agent_url else None
            self._per_loop[loop] = (genv, agent, http)
        return self._per_loop[loop]

    def gym(self) -> GenvClient:
        return self._clients()[0]

    def agent(self) -> MiniAgentClient | None:
        """The agent service's client; None without an agent URL (``agent.mode: builtin``)."""
        return self._clients()[1]

    def http(self) -> httpx.AsyncClient:
        """The plain client the others share (image fetches, probes)."""
        return self._clients()[2]

    def agent_loop(self, config: LoopConfig) -> AgentLoop:
        """The running loop's agent loop with these settings: one connection pool and
        vocabulary cache for every builtin episode. Its own pool, not the shared client's: each
        episode holds a connection through every model call (a weight update can hold one for
        minutes), which must not starve the gym and monitor calls."""
        loops = self._agent_loops.setdefault(asyncio.get_running_loop(), {})
        key = repr(config)
        if key not in loops:
            loops[key] = AgentLoop(config)
        return loops[key]

    @property
    def monitor(self) -> MonitorClient | None:
        """The running loop's monitor client, once one was made."""
        try:
            return self._monitors.get(asyncio.get_running_loop())
        except RuntimeError:  # no running loop
            return None

    async def monitor_client(self) -> MonitorClient | None:
        if self._monitor_config is None:
            return None
        loop = asyncio.get_running_loop()
        if loop not in self._monitors:
            client = MonitorClient(self._monitor_config)
            await client.start()
            self._monitors[loop] = client
        return self._monitors[loop]

    def background(self) -> set[asyncio.Future]:
        """The gym's terminates still running in the background on this loop."""
        found = self._per_loop.get(asyncio.get_running_loop())
        return set(found[0].background()) if found else set()

    async def aclose(self, timeout: float = 10.0) -> None:
        """Flush the running loop's monitor (for up to ``timeout`` s: what is left is spooled)
        and close its HTTP clients (those of other loops cannot be closed from here; they go with
        their loop). A later call makes fresh ones."""
        loop = asyncio.get_running_loop()
        monitor = self._monitors.pop(loop, None)
        if monitor is not None:
            await monitor.close(timeout=timeout)
        for agent_loop in self._agent_loops.pop(loop, {}).values():
            await agent_loop.aclose()
        clients = self._per_loop.pop(loop, None)
        if clients is not None:
            await clients[2].aclose()


class RolloutRuntime:
    """See the module docstring. ``client_factory``: the gateway's model-server client (tests
    inject faults through its transport)."""

    def __init__(
        self,
        settings: WorkflowSettings,
        *,
        client_factory: Callable[[], httpx.AsyncClient] | None = None,
    ):
        self.settings = settings
        self.key = runtime_key(settings)
        self.clients = ServiceClients(settings)
        self.outages = Outages()
        self.weight_pauses = WeightPauses()
        self.outcomes = OutcomeLog(settings.outcome_dir) if settings.outcome_dir else None
        self.drain = Drain(
            settings.drain,
            flush=self.flush,
            finish=self.finish,
            background=self.clients.background,
        )
        self.replay = ReplayPool(settings.group.replay.pool_per_task)
        self.groups = groups.GroupFilter(settings.group, self.replay, notes=self._notes)
        self._client_factory = client_factory
        self._gateway: Gateway | None = None
        self._agent_function: Callable[..., Any] | None = None
        self._pauses: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ServicePauses] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def of(cls, engine: Any, settings: WorkflowSettings) -> RolloutRuntime:
        """The runtime of ``engine`` (AReaL's, one per rollout worker), built on first use."""
        runtime = getattr(engine, ENGINE_ATTRIBUTE, None)
        if runtime is None:
            runtime = cls(settings)
            runtime.bind(engine)
            setattr(engine, ENGINE_ATTRIBUTE, runtime)
        elif runtime.key != runtime_key(settings):
            raise ConfigError(
                "two workflows with different services, gateway, pause, drain or group "
                "settings on one engine: a rollout worker runs one training's episodes (its "
                f"runtime was built for {runtime.key}, this workflow has {runtime_key(settings)})"
            )
        return runtime

    def bind(self, engine: Any) -> None:
        """Install the drain on ``engine``'s task runner (AReaL's ``RemoteInfEngine``:
        ``workflow_executor.dispatcher.runner``, declared in ``cua_rl.areal.support``: read
        directly, so a renamed member fails instead of leaving the run's end undrained). A
        stand-in engine whose dispatcher has no runner has none to stop: its episodes still
        drain when cancelled."""
        runner = engine.workflow_executor.dispatcher.runner
        if runner is None:
            log.info("%s has no AReaL task runner: no drain before it stops", type(engine))
            return
        self.drain.install(runner)

    # ---- the gateway ----------------------------------------------------------------------------

    @property
    def gateway(self) -> Gateway:
        """This runtime's gateway, started on first use and stopped at exit (or ``aclose``)."""
        if self._gateway is None:
            self._gateway = Gateway(
                self.settings.gateway, client_factory=self._client_factory, outages=self.outages
            ).start()
            atexit.register(self._gateway.stop)
        return self._gateway

    def open_endpoint(
        self, rollout_uuid: str, engine: Any, *, processor: Callable[[], Any], model_name: str
    ) -> ModelEndpoint:
        """The agent's OpenAI base URL for one episode: its session on the gateway, or (direct
        mode) the configured server, or one of the engine's servers in turn. ``processor``
        gives the model's processor (loaded on first use: direct mode needs none here)."""
        s = self.settings
        if s.endpoint.mode == "gateway":
            view = AReaLEngineView(engine, self.weight_pauses)
            spec = SessionSpec(view, s.sampling, processor(), model_name, s.trajectory)
            gateway = self.gateway
            url = gateway.open(rollout_uuid, spec)
            return ModelEndpoint(url, lambda: gateway.close(rollout_uuid))
        if s.endpoint.base_url:
            return ModelEndpoint(s.endpoint.base_url.rstrip("/"))
        addr = str(engine.choose_server())
        addr = addr if addr.startswith(("http://", "https://")) else f"http://{addr}"
        return ModelEndpoint(f"{addr.rstrip('/')}/v1")

    # ---- the agent ------------------------------------------------------------------------------

    async def run_agent(self, spec: RunSpec, task: EpisodeTask | None = None) -> RunResult:
        """The agent run of ``task``, to its end: on the agent service (``agent.mode: service``);
        with ``builtin``, the same loop as the local agent's, run here in the episode's task;
        with ``function``, the user's agent function (``cua_rl.agent.function``), called here
        with the task, the episode's gateway URL and its box."""
        a = self.settings.agent
        if a.mode == "builtin":
            return await run_builtin(self.clients.agent_loop(a.builtin), spec, a.driver.deadline_s)
        if a.mode == "function":
            return await run_function(self._function_run(task), spec, a.driver.deadline_s)
        agent = self.clients.agent()
        if agent is None:
            raise ConfigError("agent.mode=service needs agent.base_url (or agent.mode=builtin)")
        return await RunDriver(agent, a.driver).run(spec)

    def _function_run(self, task: EpisodeTask | None) -> FunctionRun:
        """What ``run_function`` needs of this runtime for ``task``: the callable (imported once
        per runtime), the gym client, and the calls the gateway captures for the episode."""
        if task is None:
            raise ConfigError("agent.mode=function runs an episode's agent: pass its task")
        if self.settings.endpoint.mode != "gateway":
            raise ConfigError("agent.mode=function needs endpoint.mode=gateway")
        if self._agent_function is None:
            self._agent_function = load_agent_function(self.settings.agent.function)
        gateway = self.gateway
        return FunctionRun(
            fn=self._agent_function,
            path=self.settings.agent.function,
            task=AgentTask(task.task_id, task.instruction, dict(task.data)),
            gym=self.clients.gym(),
            http=self.clients.http(),
            captured=lambda: gateway.captured(task.rollout_uuid),
        )

    # ---- service pauses -------------------------------------------------------------------------

    def service_pauses(self) -> ServicePauses:
        """The running loop's pauses: every workflow on this runtime, train and eval alike,
        waits on the same services."""
        loop = asyncio.get_running_loop()
        if loop not in self._pauses:
            outcome = self.outcomes.record if self.outcomes else None
            records = PauseRecords(
                self.settings.training_ref, outcome, lambda: self.clients.monitor
            )
            self._pauses[loop] = ServicePauses(self.settings.pause, records)
        return self._pauses[loop]

    async def admit(self, phase: str) -> float:
        """Wait at a new episode's start while a service is paused; the seconds waited. Through
        the gateway, a model server the gateway holds calls for pauses new episodes first."""
        pauses = self.service_pauses()
        if self.settings.endpoint.mode == "gateway":
            pauses.pause_for_held_calls(self.outages, self.clients.http(), phase=phase)
        return await pauses.admit()

    def pause_for(
        self,
        exc: RejectedEpisode,
        *,
        phase: str,
        task_id: str,
        created: bool,
        agent_unavailable: bool,
        choose_server: Callable[[], Any],
    ) -> None:
        """Hold new episodes when ``exc`` is its service's failure, not the episode's."""
        outage = outage_of(exc, created=created, agent_unavailable=agent_unavailable)
        if outage is None:
            return
        server = self.settings.gateway.model_server_url
        if outage.service == MODEL_SERVER and not server:
            server = str(choose_server())
        probe = probe_for(
            outage.service,
            self.settings.pause,
            genv=self.clients.gym(),
            agent=self.clients.agent(),
            http=self.clients.http(),
            task_id=task_id,
            model_server=server,
            outages=self.outages,
        )
        self.service_pauses().report(outage, probe, phase=phase)

    # ---- the group filter, the end ------------------------------------------------------------

    def enter_group(self) -> None:
        """Make this runtime's filter the one AReaL calls for the group in this context."""
        groups.enter(self.groups)

    def _notes(self) -> Callable[[str, dict], bool] | None:
        """Where the filter shows replays: the running loop's monitor client, if any."""
        monitor = self.clients.monitor
        return monitor.enqueue if monitor is not None else None

    async def flush(self, timeout: float) -> bool:
        """Stop the running loop's probes and flush its monitor client (the records of episodes
        that ended just before the run's end go out too); False if it did not finish."""
        pauses = self._pauses.pop(asyncio.get_running_loop(), None)
        if pauses is not None:
            await pauses.aclose()
        monitor = self.clients.monitor
        return True if monitor is None else await monitor.flush(timeout=timeout)

    async def finish(self, timeout: float) -> bool:
        """The run's end on the running loop (the drain's, before the runner stops the loop):
        ``flush``, then the loop's clients closed; False if the flush did not finish."""
        flushed = await self.flush(timeout)
        await self.clients.aclose(timeout=1.0)  # what the flush left is spooled
        return flushed

    async def aclose(self) -> None:
        """Stop the running loop's probes, flush its monitor, close its clients and stop the
        gateway (tests; a worker's runtime ends with its process). A later use starts afresh."""
        pauses = self._pauses.pop(asyncio.get_running_loop(), None)
        if pauses is not None:
            await pauses.aclose()
        await self.clients.aclose()
        if self._gateway is not None:
            self._gateway.stop()
            atexit.unregister(self._gateway.stop)
            self._gateway = None
