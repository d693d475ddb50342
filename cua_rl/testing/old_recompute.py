"""torch <= 2.12's FSDP2 recompute, put back into a newer torch: the CPU suite's emulation.

A GPU node trains on the torch AReaL's GPU environment resolves (2.10 for AReaL 1.0.4; lent
machines have had 2.11); this repository's ``.venv`` has torch 2.13. The two differ where
gradient checkpointing meets FSDP2's mixed precision: when a checkpointed layer is recomputed in
the backward pass, FSDP2's pre-forward hook runs in its pre-backward state, and torch <= 2.12
returns the layer's inputs as they came, uncast, where the first forward cast every floating
input to the compute dtype (pytorch issue #159359; torch 2.13 casts in that branch too, PR
#182580). Its post-forward hook likewise skips the output cast in that state.

``old_fsdp_recompute()`` makes torch 2.13 behave so for as long as it is entered: the two casts
(``FSDPState._cast_forward_inputs`` and ``FSDPState._cast_output_dtype``, which torch 2.13's
hooks look up at each call, so hooks registered before entering are covered) pass their values
through while the state is ``PRE_BACKWARD``. Nothing else changes: the first forward casts as
every torch does. On a torch whose FSDP2 lacks those methods (<= 2.12 itself) it refuses with
the reason instead of silently emulating nothing. ``tests/areal/test_recompute.py`` shows that
the emulation bites (AReaL's own actor stops on Qwen3-VL as the H200 did) and that the
project's actor holds under it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class EmulationUnavailable(RuntimeError):
    """This torch's FSDP2 does not have the members the emulation replaces."""


@contextlib.contextmanager
def old_fsdp_recompute() -> Iterator[None]:
    """FSDP2's recompute without the input and output casts, as in torch <= 2.12."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError as exc:
        raise EmulationUnavailable(f"torch's FSDP2 modules moved: {exc}") from exc
    originals = {}
    for name in ("_cast_forward_inputs", "_cast_output_dtype"):
        if not callable(getattr(FSDPState, name, None)):
            raise EmulationUnavailable(
                f"FSDPState.{name} is missing: this torch is not 2.13's FSDP2 (a torch <= 2.12 "
                "needs no emulation; a later one needs this module read again)"
            )
        originals[name] = getattr(FSDPState, name)
    cast_inputs = originals["_cast_forward_inputs"]
    cast_output = originals["_cast_output_dtype"]

    def inputs(self, args, kwargs):
        if self._training_state == TrainingState.PRE_BACKWARD:
            return args, kwargs
        return cast_inputs(self, args, kwargs)

    def output(self, out):
        if self._training_state == TrainingState.PRE_BACKWARD:
            return out
        return cast_output(self, out)

    FSDPState._cast_forward_inputs = inputs
    FSDPState._cast_output_dtype = output
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(FSDPState, name, fn)
