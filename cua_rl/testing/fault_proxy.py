"""A loopback TCP proxy that cuts answers mid-way on demand: a model server that drops calls.

Put in front of one model server (``gateway.model_server_url`` points the rollout gateway at
it), it relays bytes both ways untouched until a drop is armed: then the next answer the server
starts sending is cut after half of its first chunk, both sockets closed, as when a connection
dies while the answer is on the wire. ``drop_next(n)`` cuts the next ``n`` answers;
``drop_for(seconds)`` cuts every answer for a while; ``outage()`` cuts every answer until
``restore()``, so a test decides when a model-server outage ends instead of timing it. The upstream may be set after the proxy starts (the server's port is
often known only once it runs); a connection that arrives before waits for it.
"""

from __future__ import annotations

import asyncio
import threading
import time

CHUNK = 65536


class FaultProxy:
    """Runs its own event loop in a daemon thread; every method is thread-safe."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, wait_upstream_s: float = 600.0):
        self.host, self.port = host, port
        self.upstream: tuple[str, int] | None = None
        self.wait_upstream_s = wait_upstream_s
        self.chunks = 0  # chunks of answers relayed whole
        self.dropped = 0  # answers cut
        self._lock = threading.Lock()
        self._drops = 0
        self._drop_until = 0.0
        self._down = False
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fault proxy did not start")
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _shutdown(self) -> None:
        """Close the listener and every relay while the loop still runs (their sockets too)."""
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def set_upstream(self, host: str, port: int) -> None:
        self.upstream = (host, port)

    def drop_next(self, n: int = 1) -> None:
        with self._lock:
            self._drops += n

    def drop_for(self, seconds: float) -> None:
        with self._lock:
            self._drop_until = time.monotonic() + seconds

    def outage(self) -> None:
        with self._lock:
            self._down = True

    def restore(self) -> None:
        with self._lock:
            self._down = False

    def _take_drop(self) -> bool:
        with self._lock:
            if self._down or time.monotonic() < self._drop_until:
                return True
            if self._drops > 0:
                self._drops -= 1
                return True
            return False

    # -- the loop's side ------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, self.host, self.port)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, c_reader, c_writer) -> None:
        deadline = time.monotonic() + self.wait_upstream_s
        while self.upstream is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if self.upstream is None:
            c_writer.close()
            return
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.close()
            return
        up = asyncio.ensure_future(_pipe(c_reader, u_writer))
        try:
            await self._answers(u_reader, c_writer)
        finally:
            up.cancel()
            for w in (u_writer, c_writer):
                w.close()

    async def _answers(self, u_reader, c_writer) -> None:
        """Server to client; the first chunk after the client spoke starts an answer."""
        while True:
            chunk = await u_reader.read(CHUNK)
            if not chunk:
                return
            if self._take_drop():
                c_writer.write(chunk[: max(1, len(chunk) // 2)])
                await c_writer.drain()
                self.dropped += 1
                return
            self.chunks += 1
            c_writer.write(chunk)
            await c_writer.drain()


async def _pipe(reader, writer) -> None:
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()
