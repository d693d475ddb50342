"""One rollout worker's runtime: everything its episodes share, built in one place.

AReaL builds a new workflow for every group it submits (from the dotted path and keyword
arguments the trainer gives it) and hands each episode its worker's inference engine, so what a
worker's episodes share can live neither in the workflow nor in module globals (two trainings in
one process would share those, and tests would reset them). It lives in one ``RolloutRuntime``,
built on the engine's first episode (``RolloutRuntime.of``) and kept on that engine; a test
builds its own and passes it to the workflow. It owns:

- the gateway (started on first use), the model-server outages it holds calls through and the
  engine's weight-update pauses (``cua_rl.gateway``);
- one ``LoopScope`` per event loop, made on the loop's first episode and closed once: the service
  clients (gym, agent service or built-in agent loops, monitor) and the service pauses
  (``service_pauses``: new episodes wait while a service fails) with what their probes reach.
  httpx clients are bound to the loop they were made on, and AReaL may run episodes on a new
  loop after a restart;
- with ``agent.mode: function``, the user's agent function, imported once;
- the outcome file failfast reads, and the log's memory of what it explained once (a hook's or
  an observer's traceback);
- the drain (``drain``), installed on the engine's task runner: what closes the episodes in
  flight when the run ends;
- the replay pool and the group filter with its settings (``groups``), which AReaL calls with a
  group's rows in the context the workflow puts it in (``enter_group``).

Each episode gets an ``EpisodeScope`` (``episode``): its task and settings, this runtime, its
loop's scope and the engine; the pipeline opens the episode's model endpoint and box through it,
and its observers are made from it (``cua_rl.rollout.observers``).

The settings that make a runtime (services, gateway, pauses, drain, groups: ``runtime_key``) must
be the same for every workflow on one engine (a worker's eval and baseline passes are); a
workflow whose differ is refused rather than given another's.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from cua_rl.agent.builtin import run_builtin
from cua_rl.agent.function import AgentTask, FunctionRun, load_agent_function, run_function
from cua_rl.agent.loop import AgentLoop, LoopConfig
from cua_rl.agent.service_driver import RunDriver
from cua_rl.agent.spec import RunResult, RunSpec
from cua_rl.clients.gbox_mini_agent import MiniAgentClient
from cua_rl.clients.genv import GenvClient
from cua_rl.errors import ConfigError
from cua_rl.gateway import AReaLEngineView, Gateway, SessionSpec
from cua_rl.gateway.model_outages import Outages
from cua_rl.gateway.weight_pauses import WeightPauses
from cua_rl.logs import get_logger
from cua_rl.monitor.worker.client import MonitorClient, MonitorClientConfig
from cua_rl.rollout import groups
from cua_rl.rollout.drain import Drain
from cua_rl.rollout.episode import EpisodeTask, ModelEndpoint
from cua_rl.rollout.outcomes import OutcomeLog
from cua_rl.rollout.placement import is_surplus
from cua_rl.rollout.service_pauses import PauseRecords, ProbeTargets, ServicePauses
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


def monitor_config(s: WorkflowSettings) -> MonitorClientConfig | None:
    """The worker's monitor client config, from what the launcher resolved (None: no monitor)."""
    if not s.monitor_base_url:
        return None
    return MonitorClientConfig(
        base_url=s.monitor_base_url,
        # Resolved by the launcher (MonitorSection.resolved): "" is no token, and the worker's
        # own environment is not read for one.
        token=s.monitor_token,
        spool_path=s.monitor_spool_path or None,
    )


class LoopScope:
    """What one event loop's episodes share, made on the loop's first use and closed once
    (``aclose``): the plain HTTP client and the gym and agent service clients on it, the built-in
    agent loops, the monitor client (started on first use) and the service pauses. In
    ``agent.mode: builtin`` or ``function`` there is no agent service: ``agent()`` is None."""

    def __init__(
        self,
        s: WorkflowSettings,
        monitor: MonitorClientConfig | None,
        outages: Outages,
        outcomes: OutcomeLog | None,
    ):
        self._settings = s
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0))
        # Made on first use: a runtime need not name every service (an eval-only test, no agent).
        self._gym: GenvClient | None = None
        self._agent: MiniAgentClient | None = None
        self._agent_loops: dict[str, AgentLoop] = {}
        self._monitor_config = monitor
        self._monitor: MonitorClient | None = None
        self._pause_parts = (outages, outcomes)
        self.pauses = self._new_pauses()

    def _new_pauses(self) -> ServicePauses:
        s, (outages, outcomes) = self._settings, self._pause_parts
        records = PauseRecords(
            s.training_ref, outcomes.record if outcomes else None, lambda: self._monitor
        )
        targets = ProbeTargets(
            self.gym, self.agent, self._http, outages, s.gateway.model_server_url
        )
        return ServicePauses(s.pause, records, targets)

    def gym(self) -> GenvClient:
        if self._gym is None:
            g = self._settings.gym
            self._gym = GenvClient(g.base_url, g.gym_id, client=self._http, timeouts=g.timeouts)
        return self._gym

    def agent(self) -> MiniAgentClient | None:
        """The agent service's client; None without an agent service."""
        a = self._settings.agent
        if a.mode != "service" or not a.base_url:
            return None
        if self._agent is None:
            self._agent = MiniAgentClient(a.base_url, client=self._http)
        return self._agent

    def http(self) -> httpx.AsyncClient:
        """The plain client the others share (image fetches, probes)."""
        return self._http

    def agent_loop(self, config: LoopConfig) -> AgentLoop:
        """The agent loop with these settings: one connection pool and vocabulary cache for
        every builtin episode of the loop. Its own pool, not the shared client's: each episode
        holds a connection through every model call (a weight update can hold one for minutes),
        which must not starve the gym and monitor calls."""
        key = repr(config)
        if key not in self._agent_loops:
            self._agent_loops[key] = AgentLoop(config)
        return self._agent_loops[key]

    @property
    def monitor(self) -> MonitorClient | None:
        """The monitor client, once one was made."""
        return self._monitor

    async def monitor_client(self) -> MonitorClient | None:
        """The monitor client, started on first use; None without a monitor."""
        if self._monitor_config is None:
            return None
        if self._monitor is None:
            client = MonitorClient(self._monitor_config)
            await client.start()
            self._monitor = client
        return self._monitor

    def background(self) -> set[asyncio.Future]:
        """The gym's terminates still running in the background."""
        return set(self._gym.background()) if self._gym is not None else set()

    async def end_pauses(self) -> None:
        """Stop probing (the run ends; waiting episodes are the drain's to cancel): a later
        episode finds no pause open."""
        pauses, self.pauses = self.pauses, self._new_pauses()
        await pauses.aclose()

    async def flush(self, timeout: float) -> bool:
        """Stop the probes and flush the monitor client (the records of episodes that ended
        just before the run's end go out too); False if it did not finish."""
        await self.end_pauses()
        return True if self._monitor is None else await self._monitor.flush(timeout=timeout)

    async def aclose(self, timeout: float = 10.0) -> None:
        """Stop the probes, flush the monitor (for up to ``timeout`` s: what is left is spooled)
        and close every client."""
        await self.end_pauses()
        if self._monitor is not None:
            await self._monitor.close(timeout=timeout)
        for agent_loop in self._agent_loops.values():
            await agent_loop.aclose()
        await self._http.aclose()


@dataclass
class EpisodeScope:
    """What one episode is given of its worker (``RolloutRuntime.episode``): its task and
    settings, the runtime and the event loop's scope it runs in, AReaL's engine, whether it is an
    eval pass, the stats scope it counts under, the model's processor (``processor()``, loaded on
    first use) and the served model's name. The pipeline opens the episode's model endpoint and
    box through it (``cua_rl.rollout.episode.EpisodeServices``); ``cua_rl.rollout.observers``
    makes its observers from it."""

    task: EpisodeTask
    settings: WorkflowSettings
    runtime: RolloutRuntime
    loop: LoopScope
    engine: Any
    is_eval: bool
    stat_scope: str
    processor: Callable[[], Any]
    model_name: str
    _recorded: bool | None = field(default=None, init=False, repr=False)

    def open_endpoint(self) -> ModelEndpoint:
        return self.runtime.open_endpoint(
            self.task.rollout_uuid,
            self.engine,
            processor=self.processor,
            model_name=self.model_name,
        )

    def open_box(self):
        """The gym execution of the episode's task, terminated on every exit (``genv``)."""
        return self.loop.gym().execution(self.task.task_id)

    def first_time(self, key: tuple) -> bool:
        return self.runtime.first_time(key)

    @property
    def surplus(self) -> bool:
        """A training rollout of a policy the run never trains: the trainer prefetches a batch
        after the last step, and it belongs to no step record."""
        s = self.settings
        return is_surplus(s.phase, self.is_eval, s.total_steps, self.task.version)

    async def monitor(self) -> MonitorClient | None:
        """The monitor client the episode is recorded through; None without a monitor, or for a
        training rollout of a policy the run never trains (the trainer prefetches a batch after
        the last step, and it belongs to no step record)."""
        if self._recorded is None:
            self._recorded = not self.surplus
            if not self._recorded:
                log.info(
                    "episode %s samples policy version %d after the last step: not recorded",
                    self.task.rollout_uuid,
                    self.task.version,
                )
        return await self.loop.monitor_client() if self._recorded else None


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
        self.monitor_config = monitor_config(settings)
        self.outages = Outages()
        self.weight_pauses = WeightPauses()
        self.outcomes = OutcomeLog(settings.outcome_dir) if settings.outcome_dir else None
        self.drain = Drain(
            settings.drain,
            flush=self.flush,
            finish=self.finish,
            background=self._background,
        )
        self.replay = ReplayPool(settings.group.replay.pool_per_task)
        self.groups = groups.GroupFilter(settings.group, self.replay, notes=self._notes)
        self._client_factory = client_factory
        self._gateway: Gateway | None = None
        self._agent_function: Callable[..., Any] | None = None
        # One scope per event loop, keyed by the loop itself, weakly: a loop's id can be reused
        # once it is gone.
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopScope] = (
            weakref.WeakKeyDictionary()
        )
        self._explained: set[tuple] = set()
        self._explained_lock = threading.Lock()

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

    # ---- the event loop's scope, the episode's -------------------------------------------------

    def scope(self) -> LoopScope:
        """The running event loop's scope, made on first use."""
        loop = asyncio.get_running_loop()
        if loop not in self._loops:
            self._loops[loop] = LoopScope(
                self.settings, self.monitor_config, self.outages, self.outcomes
            )
        return self._loops[loop]

    @property
    def clients(self) -> LoopScope:
        """The running loop's service clients: its scope."""
        return self.scope()

    @property
    def monitor(self) -> MonitorClient | None:
        """The running loop's monitor client, once one was made (None outside a loop)."""
        try:
            found = self._loops.get(asyncio.get_running_loop())
        except RuntimeError:  # no running loop
            return None
        return found.monitor if found else None

    def _background(self) -> set[asyncio.Future]:
        found = self._loops.get(asyncio.get_running_loop())
        return found.background() if found else set()

    def episode(
        self,
        task: EpisodeTask,
        engine: Any,
        *,
        is_eval: bool,
        stat_scope: str,
        processor: Callable[[], Any],
        model_name: str,
    ) -> EpisodeScope:
        """The scope of one episode of ``task`` on ``engine`` in the running loop."""
        return EpisodeScope(
            task, self.settings, self, self.scope(), engine, is_eval, stat_scope, processor,
            model_name,
        )  # fmt: skip

    def first_time(self, key: tuple) -> bool:
        """True once per ``key`` in this runtime: what the log explains once (a hook's or an
        observer's traceback), not once per episode."""
        with self._explained_lock:
            if key in self._explained:
                return False
            self._explained.add(key)
            return True

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
            return await run_builtin(self.scope().agent_loop(a.builtin), spec, a.driver.deadline_s)
        if a.mode == "function":
            return await run_function(self._function_run(task), spec, a.driver.deadline_s)
        agent = self.scope().agent()
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
            gym=self.scope().gym(),
            http=self.scope().http(),
            captured=lambda: gateway.captured(task.rollout_uuid),
        )

    # ---- service pauses -------------------------------------------------------------------------

    def service_pauses(self) -> ServicePauses:
        """The running loop's pauses: every workflow on this runtime, train and eval alike,
        waits on the same services."""
        return self.scope().pauses

    async def admit(self, phase: str) -> float:
        """Wait at a new episode's start while a service is paused; the seconds waited. Through
        the gateway, a model server the gateway holds calls for pauses new episodes first."""
        scope = self.scope()
        if self.settings.endpoint.mode == "gateway":
            scope.pauses.pause_for_held_calls(self.outages, scope.http(), phase=phase)
        return await scope.pauses.admit()

    # ---- the group filter, the end ------------------------------------------------------------

    def enter_group(self) -> None:
        """Make this runtime's filter the one AReaL calls for the group in this context."""
        groups.enter(self.groups)

    def _notes(self) -> Callable[[str, dict], bool] | None:
        """Where the filter shows replays: the running loop's monitor client, if any."""
        monitor = self.monitor
        return monitor.enqueue if monitor is not None else None

    async def flush(self, timeout: float) -> bool:
        """Stop the running loop's probes and flush its monitor client (the records of episodes
        that ended just before the run's end go out too); False if it did not finish."""
        found = self._loops.get(asyncio.get_running_loop())
        return True if found is None else await found.flush(timeout)

    async def finish(self, timeout: float) -> bool:
        """The run's end on the running loop (the drain's, before the runner stops the loop):
        ``flush``, then the loop's scope closed; False if the flush did not finish."""
        flushed = await self.flush(timeout)
        found = self._loops.pop(asyncio.get_running_loop(), None)
        if found is not None:
            await found.aclose(timeout=1.0)  # what the flush left is spooled
        return flushed

    async def aclose(self) -> None:
        """Close the running loop's scope (probes stopped, monitor flushed, clients closed) and
        stop the gateway (tests; a worker's runtime ends with its process). A later use starts
        afresh."""
        found = self._loops.pop(asyncio.get_running_loop(), None)
        if found is not None:
            await found.aclose()
        if self._gateway is not None:
            self._gateway.stop()
            atexit.unregister(self._gateway.stop)
            self._gateway = None
