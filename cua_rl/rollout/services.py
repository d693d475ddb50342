"""The service clients the workflows of one process use: gym, agent and monitor.

In ``agent.mode: builtin`` there is no agent service: the agent client is ``None`` and
``agent_loop`` gives the running loop's ``AgentLoop`` (on the same HTTP client) instead.

AReaL builds a new workflow instance for every episode it submits (the workflow travels to the
rollout worker as a dotted path and kwargs), so clients owned by an instance were a connection
pool and a monitor client (with its task and spool) per episode, never closed: the rollout
worker's open sockets grew with every step. ``Services.shared`` gives every instance of a process
with the same service settings one set. httpx clients are bound to the event loop they were
created on, and AReaL may run workflows on a new loop after a restart, so the clients are kept
per loop. ``aclose`` closes them; a later call makes fresh ones.
"""

from __future__ import annotations

import asyncio
import weakref

import httpx

from cua_rl.agent.loop import AgentLoop, LoopConfig
from cua_rl.clients.gbox_mini_agent import MiniAgentClient
from cua_rl.clients.genv import GenvClient, GenvTimeouts
from cua_rl.monitor.worker.client import MonitorClient, MonitorClientConfig


class Services:
    """Lazily made clients; see the module docstring for why one set serves a process."""

    def __init__(
        self,
        *,
        gym_base_url: str,
        gym_id: str,
        gym_timeouts: GenvTimeouts,
        agent_base_url: str,
        monitor: MonitorClientConfig | None,
    ):
        self._gym = (gym_base_url, gym_id, gym_timeouts)
        self._agent_url = agent_base_url
        self._monitor_config = monitor
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

    @classmethod
    def shared(cls, s) -> Services:
        """This process's Services for the service settings of ``s`` (made on first use)."""
        return cls.from_settings(s).register()

    def register(self) -> Services:
        """The process's Services with these settings: this one, unless one was registered
        before. Registered Services are those the end-of-run drain flushes."""
        return _SHARED.setdefault(self.key, self)

    @property
    def key(self) -> str:
        return repr((self._gym, self._agent_url, self._monitor_config))

    @classmethod
    def from_settings(cls, s) -> Services:
        """From the workflow's settings (gym, agent and monitor fields)."""
        monitor = None
        if s.monitor_base_url:
            monitor = MonitorClientConfig(
                base_url=s.monitor_base_url,
                # Resolved by the launcher (MonitorSection.resolved): "" is no token, and the
                # worker's own environment is not read for one.
                token=s.monitor_token,
                spool_path=s.monitor_spool_path or None,
            )
        return cls(
            gym_base_url=s.gym.base_url,
            gym_id=s.gym.gym_id,
            gym_timeouts=s.gym.timeouts,
            agent_base_url=s.agent.base_url if s.agent.mode == "service" else "",
            monitor=monitor,
        )

    def clients(self) -> tuple[GenvClient, MiniAgentClient | None, httpx.AsyncClient]:
        """(gym, agent, plain http) for the running loop; no agent client without an agent URL
        (``agent.mode: builtin``)."""
        loop = asyncio.get_running_loop()
        if loop not in self._per_loop:
            base, gym_id, timeouts = self._gym
            http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0))
            genv = GenvClient(base, gym_id, client=http, timeouts=timeouts)
            agent = MiniAgentClient(self._agent_url, client=http) if self._agent_url else None
            self._per_loop[loop] = (genv, agent, http)
        return self._per_loop[loop]

    def agent_loop(self, config: LoopConfig) -> AgentLoop:
        """The running loop's agent loop with these settings: one connection pool and
        vocabulary cache for every builtin episode of the process. Its own pool, not the shared
        client's: each episode holds a connection through every model call (a weight update
        can hold one for minutes), which must not starve the gym and monitor calls."""
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

    async def aclose(self) -> None:
        """Flush the running loop's monitor and close its HTTP clients (those of other loops
        cannot be closed from here; they go with their loop)."""
        loop = asyncio.get_running_loop()
        monitor = self._monitors.pop(loop, None)
        if monitor is not None:
            await monitor.close()
        for agent_loop in self._agent_loops.pop(loop, {}).values():
            await agent_loop.aclose()
        clients = self._per_loop.pop(loop, None)
        if clients is not None:
            await clients[2].aclose()


_SHARED: dict[str, Services] = {}


def loop_monitors() -> list[MonitorClient]:
    """Every monitor client the process's registered Services made on the running loop."""
    loop = asyncio.get_running_loop()
    return [m for s in list(_SHARED.values()) if (m := s._monitors.get(loop)) is not None]
