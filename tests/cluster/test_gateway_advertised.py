"""A gateway bound on one address and advertised under another: the agent is told the advertised
URL, and that URL reaches the gateway.

On a cluster the agent runs on another host and reaches the rollout worker's gateway through an
address the worker itself does not bind (a node's public name, a port mapping, an ingress). Here
the gateway binds 127.0.0.1:<free port>; a TCP relay on 127.0.0.3:<another port> stands for the
mapping; the config advertises the relay (``gateway.public_host`` / ``public_port``). The agent's
side is the official OpenAI SDK, given exactly the URL the workflow hands the agent
(``Gateway.open``).
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from cua_rl.gateway import GatewayConfig, Sampling
from cua_rl.gateway.server import Gateway
from cua_rl.gateway.session import SessionSpec
from cua_rl.serving import bind_free_port
from cua_rl.trajectory.config import TrajectoryConfig

PUBLIC_HOST = "127.0.0.3"


class TcpRelay:
    """Accepts on ``listen_host`` and pipes each connection to ``target`` (set once known)."""

    def __init__(self, listen_host: str):
        self._sock = bind_free_port(listen_host)
        self.port = self._sock.getsockname()[1]
        self.target: tuple[str, int] | None = None
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _pipe(self, reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def _handle(self, reader, writer):
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    def __enter__(self) -> TcpRelay:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, sock=self._sock), self._loop
        )
        self._server = fut.result(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class NoEngine:
    """The episode is only listed and asked for its models here: no generation reaches it."""

    def get_version(self) -> int:
        raise AssertionError("no generation in this test")


def _spec(model_dir) -> SessionSpec:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    return SessionSpec(NoEngine(), Sampling(), processor, "tiny-vl", TrajectoryConfig())


def test_the_agent_is_told_the_public_address_and_reaches_the_gateway_through_it(
    tiny_vl_model_dir,
):
    with TcpRelay(PUBLIC_HOST) as relay:
        config = GatewayConfig(
            bind_host="127.0.0.1", public_host=PUBLIC_HOST, public_port=relay.port
        )
        gateway = Gateway(config).start()
        try:
            bound_port = gateway._server.port
            relay.target = ("127.0.0.1", bound_port)
            # What the workflow hands the agent (CUAAgentWorkflow.open_model_endpoint).
            url = gateway.open("ep-1", _spec(tiny_vl_model_dir))
            assert url == f"http://{PUBLIC_HOST}:{relay.port}/episodes/ep-1/v1"

            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=10)
            assert [m.id for m in client.models.list().data] == ["tiny-vl"]
            assert relay.connections >= 1

            # The gateway itself listens on its bind address only, not on the advertised host.
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://{PUBLIC_HOST}:{bound_port}/episodes/ep-1/v1/models", timeout=5)
        finally:
            gateway.stop()
