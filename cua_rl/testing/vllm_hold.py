"""The vLLM side of ``cua_rl.testing.hold``: a logits processor that holds a request.

Loaded into a test's server with ``--logits-processors cua_rl.testing.vllm_hold:HoldAtToken``
and ``CUA_HOLD_DIR`` in its environment, it does nothing until the test arms it (a token count N
in ``CUA_HOLD_DIR/armed``). The next engine step in which a request has N output tokens then
blocks before sampling (the engine core is one thread: nothing else is sampled either): the
processor disarms, writes ``held`` and waits until the engine core has ``pause_scheduler``
(vLLM's pause, sent by ``areal_pause_generation``) in its input queue, or until the test writes
``release``. The step then finishes (token N + 1) and the engine core handles the pause before
its next step, so the request is aborted holding N + 1 tokens, however fast the machine samples.

It must run in the engine core's process, whose input queue it reads: vLLM CPU runs the model
in a worker process of its own unless ``--distributed-executor-backend uni`` and
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (``Hold.server_args`` and ``Hold.env``; the API server stays
a process apart, as in production). vLLM's interpreter: vLLM, torch and the standard library.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from cua_rl.testing.hold import ARMED, ENV_DIR, HELD, RELEASE

# Only a safety net against a test that never pauses: the hold is released by state, not time.
MAX_HOLD_S = 600.0


def _engine_core():
    """The engine core whose busy loop runs this step: the pause arrives in its input queue.

    Found on the call stack, or else among the process's objects (a step run on another thread
    of the process)."""
    from vllm.v1.engine.core import EngineCoreProc

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, EngineCoreProc):
            return candidate
        frame = frame.f_back
    for obj in gc.get_objects():
        try:
            if isinstance(obj, EngineCoreProc):
                return obj
        except ReferenceError:  # a dead weak proxy
            continue
    raise RuntimeError(
        "HoldAtToken runs outside the engine core's process: start the server with "
        "--distributed-executor-backend uni and VLLM_ENABLE_V1_MULTIPROCESSING=0 (Hold does)"
    )


def pause_pending(core) -> bool:
    """Whether ``pause_scheduler`` waits in the engine core's input queue."""
    from vllm.v1.engine import EngineCoreRequestType

    queue = core.input_queue
    with queue.mutex:
        pending = list(queue.queue)
    return any(
        kind == EngineCoreRequestType.UTILITY and request[2] == "pause_scheduler"
        for kind, request in pending
    )


class HoldAtToken(LogitsProcessor):
    """Blocks the step in which an armed hold's token count is reached (see the module)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        folder = os.environ.get(ENV_DIR)
        self.dir = Path(folder) if folder else None
        self.outputs: dict[int, list[int]] = {}  # batch index -> the request's live output ids
        self._core = None

    def is_argmax_invariant(self) -> bool:
        return False  # applied to greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.outputs.pop(index, None)
        for index, _params, _prompt, output_ids in batch_update.added:
            self.outputs[index] = output_ids
        for a, b, direction in batch_update.moved:
            moved_a, moved_b = self.outputs.pop(a, None), self.outputs.pop(b, None)
            if moved_a is not None:
                self.outputs[b] = moved_a
            if moved_b is not None and direction.name == "SWAP":
                self.outputs[a] = moved_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.dir is None or not (self.dir / ARMED).exists():
            return logits
        at = int((self.dir / ARMED).read_text())
        produced = max((len(ids) for ids in self.outputs.values()), default=0)
        if produced >= at:
            (self.dir / ARMED).unlink()
            self._hold(produced)
        return logits

    def _hold(self, produced: int) -> None:
        if self._core is None:
            self._core = _engine_core()
        tmp = self.dir / f"{HELD}.tmp"
        tmp.write_text(str(produced))
        tmp.replace(self.dir / HELD)  # whole, for the test that reads it
        deadline = time.monotonic() + MAX_HOLD_S
        while time.monotonic() < deadline:
            if (self.dir / RELEASE).exists():
                return
            if pause_pending(self._core):
                return
            time.sleep(0.005)
