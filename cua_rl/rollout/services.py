"""The service clients the workflows of one process use: gym, agent and monitor.

AReaL builds a new workflow instance for every episode it submits (the workflow travels to the
rollout worker as a dotted path and kwargs), so clients owned by an instance were a connection
pool and a monitor client (with its task and spool) per episode, never closed: the rollout
worker's open sockets grew with every step. ``Services.shared`` gives every instance of a process
with the same service settings one set. httpx clients are bound to the event loop they were
created on, and AReaL may run workflows on a new loop after a restart, so the gym and agent
clients are kept per loop. ``aclose`` closes them; a later call makes fresh ones.
"""

from __future__ import annotations

import asyncio

import httpx

from cua_rl.genv import GenvClient, GenvTimeouts
from cua_rl.mini_agent import MiniAgentClient
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
        self._per_loop: dict[int, tuple[GenvClient, MiniAgentClient, httpx.AsyncClient]] = {}
        self.monitor: MonitorClient | None = None

    @classmethod
    def shared(cls, s) -> Services:
        """This process's Services for the service settings of ``s`` (made on first use)."""
        made = cls.from_settings(s)
        return _SHARED.setdefault(made.key, made)

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
                token=s.monitor_token or None,
                spool_path=s.monitor_spool_path or None,
            )
        return cls(
            gym_base_url=s.gym.base_url,
            gym_id=s.gym.gym_id,
            gym_timeouts=s.gym.timeouts,
            agent_base_url=s.agent.base_url,
            monitor=monitor,
        )

    def clients(self) -> tuple[GenvClient, MiniAgentClient, httpx.AsyncClient]:
        """(gym, agent, plain http) for the running loop."""
        key = id(asyncio.get_running_loop())
        if key not in self._per_loop:
            base, gym_id, timeouts = self._gym
            http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0))
            genv = GenvClient(base, gym_id, client=http, timeouts=timeouts)
            self._per_loop[key] = (genv, MiniAgentClient(self._agent_url, client=http), http)
        return self._per_loop[key]

    async def monitor_client(self) -> MonitorClient | None:
        if self._monitor_config is None:
            return None
        if self.monitor is None:
            self.monitor = MonitorClient(self._monitor_config)
            await self.monitor.start()
        return self.monitor

    async def aclose(self) -> None:
        """Flush the monitor and close the HTTP clients."""
        if self.monitor is not None:
            await self.monitor.close()
            self.monitor = None
        for *_, http in self._per_loop.values():
            await http.aclose()
        self._per_loop.clear()


_SHARED: dict[str, Services] = {}
