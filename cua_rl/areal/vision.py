"""The ``actor.vision`` config section: the vision tower's work in the trainer's actor.

``CuaActorConfig`` is AReaL's ``PPOActorConfig`` with this section, the type of ``CUAConfig.actor``;
AReaL's RPC layer sends a dataclass to the workers with its import path, so the training worker's
engine (``cua_rl.areal.actor.CuaPPOActor``) reads the section from its own config. An engine made
from a plain ``PPOActorConfig`` (the reference or teacher model) gets the defaults. Light on
purpose (no engine import); docs/vision.md explains the design and the measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal.api.cli_args import PPOActorConfig

from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError


@dataclass
class VisionSection:
    dedup: bool = doc(
        True,
        "Run the vision tower once per distinct screenshot of a micro-batch and give every "
        "placeholder span of that screenshot its embeddings (gradients summed by autograd): "
        "rows of a sliding-window agent share most screenshots. Same logprobs and gradients as "
        "AReaL's path, which encodes every image of every row; rows need image identity "
        "(image_keys, written by the converter). Falls back to AReaL's path, with a log line, "
        "under sequence parallelism, tree training, LoRA, video or rows without identity",
    )
    pack_episodes: bool = doc(
        True,
        "With dedup: fill micro-batches with the rows in batch order (an episode's rows are "
        "contiguous and in turn order) instead of AReaL's first-fit-decreasing by length, which "
        "scatters an episode's rows so that a shared screenshot is encoded in several "
        "micro-batches. Same micro-batch limits (max_tokens_per_mb, n_mbs, n_mbs_divisor)",
    )
    freeze: bool = doc(
        False,
        "Freeze the vision tower: its parameters get no gradient and keep their weights, and it "
        "runs without autograd (no activations kept for a backward pass). For a tower already "
        "good at the screens you train on, when the step's time or memory matters more than "
        "adapting what the model sees (docs/vision.md)",
    )

    def __post_init__(self) -> None:
        for name in ("dedup", "pack_episodes", "freeze"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"actor.vision.{name} must be true or false, not {value!r}")


@dataclass
class CuaActorConfig(PPOActorConfig):
    vision: VisionSection = doc(
        help="The vision tower in the trainer: one pass per distinct screenshot, freezing",
        factory=VisionSection,
    )


def vision_section(config: object) -> VisionSection:
    """The engine config's vision section; the defaults for a config without one."""
    section = config.vision if isinstance(config, CuaActorConfig) else VisionSection()
    if not isinstance(section, VisionSection):  # an OmegaConf dict left unconverted
        section = VisionSection(**dict(section))
    return section


def vision_packing_warning(actor: CuaActorConfig) -> str:
    """What scatters an episode's rows over forward passes despite ``pack_episodes``, or ""."""
    vision = actor.vision
    if not (vision.dedup and vision.pack_episodes) or actor.ppo_n_minibatches <= 1:
        return ""
    return (
        f"actor.ppo_n_minibatches={actor.ppo_n_minibatches}: AReaL splits each step's rows into "
        "PPO minibatches by length, scattering an episode's rows, so a screenshot its rows share "
        "is encoded once per minibatch that holds one of them; set actor.ppo_n_minibatches=1 "
        "to encode it once per micro-batch (docs/vision.md)"
    )
