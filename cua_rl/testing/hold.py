"""Pause a vLLM server while a request is provably in the middle of its generation.

A test that pauses the server (AReaL's weight update) "while a call is sampling" must not
depend on how fast the call samples: a pause sent after a delay, or on a metric, lands before,
during or after the call depending on the machine. ``Hold`` makes the moment exact: the test's
server loads ``cua_rl.testing.vllm_hold`` (its ``server_args()`` and ``env()``), the test arms
the hold at N tokens, starts its call and waits until the server holds it at N; the server
samples nothing more until the pause reaches its engine, which then aborts the call holding
N + 1 tokens. This module is the test's side: it imports nothing from vLLM.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from cua_rl.cpu.training import ENV_INPROC_WORKER

ENV_DIR = "CUA_HOLD_DIR"
FQCN = "cua_rl.testing.vllm_hold:HoldAtToken"
ARMED, HELD, RELEASE = "armed", "held", "release"


class Hold:
    """A hold shared with one vLLM server through the files of ``folder``."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def server_args(self) -> list[str]:
        # The worker in the engine core's process: the hold watches the engine's input queue.
        return ["--logits-processors", FQCN, "--distributed-executor-backend", "uni"]

    def env(self) -> dict[str, str]:
        # vLLM CPU turns "uni" into "mp" (a worker process) unless this is 0; the API server
        # and the engine core stay separate processes either way (AsyncLLM ignores it).
        return {ENV_DIR: str(self.folder), ENV_INPROC_WORKER: "0"}

    def arm(self, at_tokens: int) -> None:
        """Hold the next request that reaches ``at_tokens`` output tokens (once)."""
        if at_tokens < 1:
            raise ValueError(f"at_tokens={at_tokens}: hold after at least one token")
        for name in (HELD, RELEASE):
            (self.folder / name).unlink(missing_ok=True)
        (self.folder / ARMED).write_text(str(at_tokens))

    async def held(self, call: asyncio.Task) -> int:
        """The output tokens of the held request, once the server holds it; fails if ``call``
        ends first (the hold never fired)."""
        while not call.done():
            if (self.folder / HELD).exists():
                return int((self.folder / HELD).read_text())
            await asyncio.sleep(0.01)
        raise AssertionError(f"the call ended without being held: {call.result()!r}")

    def release(self) -> None:
        """Let a held server go on without a pause."""
        (self.folder / RELEASE).write_text("")
