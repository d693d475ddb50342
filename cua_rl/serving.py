"""Run an ASGI app with uvicorn on a loopback port in a background thread.

Used where a service must live inside another process: the embedded monitor of train.py, and
tests. The socket is bound before the thread starts, so the port is known (and reserved) at once
and there is no race between picking a free port and serving on it.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any

import uvicorn


def bind_free_port(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class ThreadedServer:
    """``with ThreadedServer(app) as srv: srv.url``: serves until the block ends."""

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "asgi",
        log_level: str = "warning",
    ):
        self.host, self.name = host, name
        self._sock = bind_free_port(host, port)
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(
            uvicorn.Config(
                app, log_level=log_level, lifespan="on", access_log=False, timeout_keep_alive=30
            )
        )
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> ThreadedServer:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True, name=self.name
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start on {self.url} within {timeout}s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._sock.close()

    def serve_until_interrupted(self, *, ready: str) -> int:
        """For a command-line server: start, print ``ready`` (launchers wait for that line), serve
        until SIGINT, SIGTERM or the server exits, then stop. Returns the exit code.

        Both signals are handled explicitly: a process started in the background by a
        non-interactive shell inherits SIGINT as ignored, and a launcher's SIGTERM should stop
        the server as cleanly as Ctrl-C does."""

        def interrupt(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt(signal.Signals(signum).name)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, interrupt)
        self.start()
        print(ready, flush=True)
        try:
            while self._thread.is_alive():
                self._thread.join(1.0)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()
        return 0

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
