"""The ``logits`` config section: selective logits on or off, and the trainer it selects.

Light on purpose (no AReaL engine import), so loading a config stays cheap; the engine and
trainer classes are in ``logits_engine``, which ``trainer_class`` imports only when they are
used. docs/logits.md explains the design and the measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from cua_rl.areal.support import SUPPORTED_AREAL, check_areal_version
from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError


@dataclass
class LogitsConfig:
    selective: bool = doc(
        True,
        (
            "Run the LM head and log-softmax only at the positions the PPO loss reads "
            "(AReaL's FSDP actor otherwise computes full-vocabulary logits at every token of "
            "a packed micro-batch, screenshot tokens included). Same logprobs, loss, "
            f"gradients and logged statistics; needs AReaL {SUPPORTED_AREAL} and applies to "
            "the fsdp backend's actor, reference and teacher (docs/logits.md)"
        ),
    )

    def __post_init__(self) -> None:
        if not isinstance(self.selective, bool):
            raise ConfigError(f"logits.selective must be true or false, not {self.selective!r}")


def trainer_class(config: LogitsConfig, base: type | None = None) -> type:
    """The trainer class to construct: ``base`` (default AReaL's ``PPOTrainer``) with cua-rl's
    fsdp actor (``actor.with_actor``, whose module applies the trainer-side fixes), or with
    selective logits (``logits_engine.with_selective_logits``, the same actor's subclass)."""
    if base is None:
        from areal import PPOTrainer

        base = PPOTrainer
    if not config.selective:
        from cua_rl.areal.actor import with_actor

        return with_actor(base)
    check_areal_version()
    from cua_rl.areal.logits_engine import with_selective_logits

    return with_selective_logits(base)
