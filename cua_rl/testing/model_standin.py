"""A stand-in for vLLM's tokens-in endpoint, for faults and load the real server cannot stage.

``POST /inference/v1/generate`` answers in vLLM's shape (the prompt ids as sent, ``output_ids``
as sampled, a logprob per token) after ``latency_s``; ``mode="abort"`` aborts every call with no
token, as a server shutting down does. ``hold`` (a ``threading.Event``) keeps every answer back
until it is set, so a test decides when a call is "still running" instead of timing it;
``script`` gives each call its own answer (a tool call, say). Counts the calls it got. Serve it with ``cua_rl.serving.ThreadedServer``.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from fastapi import FastAPI, Request


class StaticEngine:
    """What the gateway and the workflow read of AReaL's engine, for benches: one server, never
    paused, and a workflow executor whose dispatcher has no task runner (nothing to drain when
    a bench ends: it awaits its episodes)."""

    def __init__(self, address: str):
        self.address = address
        self.workflow_executor = SimpleNamespace(
            is_paused=self.is_paused, dispatcher=SimpleNamespace(runner=None)
        )

    def get_version(self) -> int:
        return 0

    def is_paused(self) -> bool:
        return False

    def choose_server(self) -> str:
        return self.address


class ModelStandIn:
    def __init__(
        self,
        *,
        output_ids: tuple[int, ...] = (40, 41, 42, 43),
        latency_s: float = 0.0,
        mode: str = "stop",
        hold: threading.Event | None = None,
        script: tuple[tuple[int, ...], ...] = (),
    ):
        self.output_ids, self.latency_s, self.mode, self.hold = output_ids, latency_s, mode, hold
        # The n-th call answers script[n] (the last one again after that); empty: output_ids.
        self.script = script
        self.calls = 0
        self.last: dict = {}  # the last request body
        self._arrived = threading.Condition()
        self.app = FastAPI(title="model stand-in")
        self.app.post("/inference/v1/generate")(self.generate)
        self.app.get("/health")(self.health)

    async def health(self) -> dict:
        """vLLM's liveness route (the rollout side probes it while the server is out)."""
        return {}

    def wait_calls(self, n: int, timeout: float = 300.0) -> None:
        """Block until ``n`` calls arrived (``timeout`` only guards a test against a hang)."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: self.calls >= n, timeout):
                raise TimeoutError(f"{self.calls} of {n} calls arrived")

    async def generate(self, request: Request) -> dict:
        body = await request.json()
        with self._arrived:
            self.calls += 1
            self.last = body
            n = self.calls
            self._arrived.notify_all()
        if self.hold is not None:
            await asyncio.to_thread(self.hold.wait)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if self.mode == "abort":
            out: list[int] = []
        else:
            room = int(body["sampling_params"]["max_tokens"])
            script = self.script[min(n, len(self.script)) - 1] if self.script else None
            out = list((script if script is not None else self.output_ids)[:room])
        return {
            "prompt_token_ids": body["token_ids"],
            "choices": [
                {
                    "token_ids": out,
                    "logprobs": {"content": [{"logprob": -0.5} for _ in out]},
                    "finish_reason": self.mode,
                }
            ],
        }
