"""The ``logits`` config section: selective logits on or off, and the trainer it selects.

Light on purpose (no AReaL engine import), so loading a config stays cheap; the engine and
trainer classes are in ``logits_engine``, which ``trainer_class`` imports only when they are
used. docs/logits.md explains the design and the measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from cua_rl.errors import ConfigError

# The AReaL release whose FSDPEngine methods logits_engine's overrides mirror (fsdp_engine.py:
# forward_backward_batch, forward_batch, _prepare_mb_inputs, _compute_logprobs[_entropy],
# _get_vocab_min_max_logits) and whose PPOTrainer._create_train_engine it extends. Another
# release needs them re-read.
SUPPORTED_AREAL = "1.0.4"


@dataclass
class LogitsConfig:
    selective: bool = field(
        default=True,
        metadata={
            "help": "Run the LM head and log-softmax only at the positions the PPO loss reads "
            "(AReaL's FSDP actor otherwise computes full-vocabulary logits at every token of "
            "a packed micro-batch, screenshot tokens included). Same logprobs, loss, "
            f"gradients and logged statistics; needs AReaL {SUPPORTED_AREAL} and applies to "
            "the fsdp backend's actor, reference and teacher (docs/logits.md)"
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.selective, bool):
            raise ConfigError(f"logits.selective must be true or false, not {self.selective!r}")


def areal_version() -> str:
    try:
        return version("areal")
    except PackageNotFoundError:
        return "not installed"


def check_areal_version() -> None:
    """Refuse to run the overrides on an AReaL release they were not written against."""
    found = areal_version()
    if found != SUPPORTED_AREAL:
        raise ConfigError(
            f"logits.selective overrides FSDPEngine methods of AReaL {SUPPORTED_AREAL}, and "
            f"AReaL {found} is installed: set logits.selective=false, or check "
            "cua_rl/areal/logits_engine.py against the new fsdp_engine.py and update "
            "SUPPORTED_AREAL in cua_rl/areal/logits.py"
        )


def trainer_class(config: LogitsConfig, base: type | None = None) -> type:
    """The trainer class to construct: ``base`` (default AReaL's ``PPOTrainer``) as it is, or
    with selective logits (``logits_engine.with_selective_logits``)."""
    if base is None:
        from areal import PPOTrainer

        base = PPOTrainer
    if not config.selective:
        return base
    check_areal_version()
    from cua_rl.areal.logits_engine import with_selective_logits

    return with_selective_logits(base)
