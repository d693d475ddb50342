"""The ``step_credit`` config section: which steps share a state, and how much their credit weighs.

Documented field by field (``doc``) and validated where it is built, so a mistake is a
``ConfigError`` naming the key and its fix. The section travels to the rollout workers inside
the group filter's settings (``cua_rl.rollout.groups.GroupSettings``): it must stay plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError

KEY_MODES = ("auto", "gym", "phash", "exact")


def _status_bar() -> list[list[float]]:
    # A phone's status bar (clock, battery, notifications) is its top 2.5-4 %; 5 % leaves margin.
    return [[0.0, 0.0, 1.0, 0.05]]


@dataclass
class StateKeyConfig:
    """How a step's state is named (docs/credit.md, *State keys*)."""

    mode: str = doc(
        "auto",
        "auto: the gym's own state key where its action answer names one (state_key_before), "
        "else a perceptual hash of the screenshot the agent saw before the step; gym: the "
        "gym's key only (a step without one groups with nothing); phash: the perceptual hash "
        "only; exact: the screenshot's bytes (sha256), the strict mode: any changed pixel is "
        "another state",
    )
    hash_size: int = doc(
        8, "phash: side of the hash's DCT grid; the hash has hash_size**2 bits (8: 64 bits)"
    )
    threshold: int = doc(
        4,
        "phash: two screenshots whose hashes differ in at most this many bits are one state "
        "(0: equal hashes only). On the local phone a changed clock moves 0 bits with the "
        "status bar masked, a flipped Wi-Fi switch 16 of 64",
    )
    # list[Any]: OmegaConf would refuse an int inside a list[list[float]] ([0, 0, 1, 0.05]).
    mask: list[Any] = doc(
        help="phash: regions blanked before hashing, each [x0, y0, x1, y1] in fractions of the "
        "screenshot's width and height; default: a phone's status bar (the top 5 %), whose "
        "clock would otherwise make every screenshot a new state. [] hashes the whole image",
        factory=_status_bar,
    )

    def __post_init__(self) -> None:
        if self.mode not in KEY_MODES:
            raise ConfigError(
                f"step_credit.key.mode={self.mode!r}; use one of {', '.join(KEY_MODES)}"
            )
        if not 2 <= self.hash_size <= 32:
            raise ConfigError(
                f"step_credit.key.hash_size={self.hash_size} must be within 2..32 (8: 64 bits)"
            )
        if not 0 <= self.threshold < self.hash_size**2:
            raise ConfigError(
                f"step_credit.key.threshold={self.threshold} must be within 0..{self.hash_size**2 - 1} "
                "(bits of the hash that may differ), e.g. 4"
            )
        for region in self.mask:
            ok = isinstance(region, list | tuple) and len(region) == 4
            if not ok or not all(isinstance(v, int | float) and 0 <= v <= 1 for v in region):
                raise ConfigError(
                    f"step_credit.key.mask region {region!r} must be [x0, y0, x1, y1] in "
                    "fractions 0..1 of the screenshot, e.g. [0, 0, 1, 0.05]"
                )
            if region[0] >= region[2] or region[1] >= region[3]:
                raise ConfigError(
                    f"step_credit.key.mask region {list(region)} is empty: x0 < x1 and y0 < y1"
                )
        self.mask = [[float(v) for v in region] for region in self.mask]

    @property
    def hashes(self) -> bool:
        """Whether steps may need a perceptual hash (imagehash must import)."""
        return self.mode in ("auto", "phash")


@dataclass
class StepCreditConfig:
    """Step credit from screen states (GiGPO's anchor states; docs/credit.md). Off by default:
    docs/learning.md measures it against episode credit."""

    enabled: bool = doc(
        False,
        "Give each step of an episode its own advantage besides its episode's: steps of a "
        "task's group that start from one state form a step group, and each step's return minus "
        "its step group's mean is added (times weight) to the advantage of its tokens",
    )
    weight: float = doc(
        1.0, "w: a token's advantage is its episode's plus w times its step's (GiGPO uses 1)"
    )
    gamma: float = doc(
        1.0,
        "Discount of a step's return: reward * gamma**(steps after it). 1 by default: the local "
        "agent runs every episode to agent.max_steps, so steps after the task was done would "
        "otherwise be credited by how late they came; < 1 for agents that stop when done",
    )
    std_scale: bool = doc(
        False, "Divide each step advantage by its step group's std (+eps); off: centred only"
    )
    eps: float = doc(1e-5, "Added to the std before dividing (std_scale)")
    max_episodes: int = doc(
        4096,
        "Episodes a rollout worker keeps step data for until their group reaches the filter "
        "(the oldest are dropped first, and counted as cua/credit/unknown_episodes)",
    )
    key: StateKeyConfig = doc(help="How a step's state is named", factory=StateKeyConfig)

    def __post_init__(self) -> None:
        if isinstance(self.key, dict):
            self.key = StateKeyConfig(**self.key)
        if not self.weight > 0:
            raise ConfigError(
                f"step_credit.weight={self.weight} must be > 0 (turn step credit off with "
                "step_credit.enabled=false)"
            )
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"step_credit.gamma={self.gamma} must be within (0, 1], e.g. 1.0")
        if self.eps < 0:
            raise ConfigError(f"step_credit.eps={self.eps} must be >= 0, e.g. 1e-5")
        if self.max_episodes < 1:
            raise ConfigError(
                f"step_credit.max_episodes={self.max_episodes} must be >= 1, e.g. 4096"
            )
