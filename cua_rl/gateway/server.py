"""The gateway of one rollout worker: a registry of open episodes behind one HTTP server.

The server runs in its own thread with its own event loop (``cua_rl.serving.ThreadedServer``),
so prompt rendering and image decoding never stall the loop AReaL runs workflows on, and the
workflow reads what its episode captured from shared memory, without another hop. Episodes are
opened and closed from the workflow's thread; the registry is guarded by a lock. The gateway owns
what its sessions share: the model-server outages it holds calls through (``outages``) and the
pad-count fallbacks already logged. The rollout runtime (``cua_rl.rollout.runtime``) makes one
per worker and starts it on first use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx

from cua_rl.gateway.app import create_app
from cua_rl.gateway.capture import CapturedTurn, EpisodeCapture
from cua_rl.gateway.config import GatewayConfig
from cua_rl.gateway.model_outages import Outages
from cua_rl.gateway.session import EpisodeSession, SessionSpec
from cua_rl.logs import get_logger
from cua_rl.serving import ThreadedServer

log = get_logger(__name__)

_WILDCARD = ("0.0.0.0", "::", "")


def public_host(config: GatewayConfig) -> str:
    if config.public_host:
        return config.public_host
    if config.bind_host in _WILDCARD:
        from areal.utils.network import gethostip

        return gethostip()
    return config.bind_host


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        client_factory: Callable[[], httpx.AsyncClient] | None = None,
        outages: Outages | None = None,
    ):
        """``client_factory`` makes the model-server client on the gateway's loop (tests inject
        faults through its transport); ``outages``: where the calls it holds are counted (the
        runtime's, which the rollout side reads; a record of its own by default)."""
        self.config = config
        self._client_factory = client_factory
        self.outages = outages if outages is not None else Outages()
        self._explained: set[str] = set()
        self._episodes: dict[str, EpisodeSession] = {}
        self._lock = threading.Lock()
        self._server: ThreadedServer | None = None

    def start(self) -> Gateway:
        if self._server is not None:
            return self
        app = create_app(
            self._lookup,
            max_body_bytes=self.config.max_body_bytes,
            models=self._models,
            client_factory=self._client_factory,
            keepalive_s=self.config.stream_keepalive_s,
            max_connections=self.config.max_connections,
        )
        host = self.config.bind_host or "0.0.0.0"
        self._server = ThreadedServer(
            app, host=host, port=self.config.bind_port, name="cua-gateway"
        ).start()
        log.info(
            "rollout gateway listening on %s:%d, advertised as %s",
            host,
            self._server.port,
            self.base_url,
        )
        return self

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("the gateway is not started")
        port = self.config.public_port or self._server.port
        return f"http://{public_host(self.config)}:{port}"

    def url_for(self, episode_id: str) -> str:
        """The OpenAI base URL the agent of this episode gets."""
        return f"{self.base_url}/episodes/{episode_id}/v1"

    def open(self, episode_id: str, spec: SessionSpec) -> str:
        with self._lock:
            if episode_id in self._episodes:
                raise ValueError(f"episode {episode_id} is already open on this gateway")
            self._episodes[episode_id] = EpisodeSession(
                episode_id, spec, self.config, self.outages, self._explained
            )
        return self.url_for(episode_id)

    def close(self, episode_id: str) -> EpisodeCapture:
        """Stop serving the episode (later calls get 404) and return what it captured."""
        with self._lock:
            session = self._episodes.pop(episode_id)
        return session.close()

    def captured(self, episode_id: str) -> list[CapturedTurn]:
        """The calls an open episode has captured so far (each is in the list before its answer
        leaves the gateway); none once it is closed."""
        session = self._lookup(episode_id)
        return list(session.capture.turns) if session is not None else []

    @property
    def open_episodes(self) -> int:
        with self._lock:
            return len(self._episodes)

    def _lookup(self, episode_id: str) -> EpisodeSession | None:
        with self._lock:
            return self._episodes.get(episode_id)

    def _models(self, episode_id: str) -> list[str]:
        session = self._lookup(episode_id)
        return [session.spec.model_name] if session else []

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
