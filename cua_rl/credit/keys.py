"""State keys: which steps of a task's episodes start from the same state.

A step's key names the state the agent acted on. Three sources, in the order ``auto`` tries
them (``StateKeyConfig.mode`` picks one):

- **gym**: the gym's own key, when its action answer names the state the action was applied to
  (``state_key_before``; docs/gym.md). Exact by construction: it is the gym's state, not its
  picture. A step that sent no action (a reply that did not parse) takes the state the previous
  action left (``state_key_after``).
- **phash**: a perceptual hash (``imagehash.phash``, a DCT of the downscaled greyscale image) of
  the screenshot the agent saw before the step, with masked regions blanked first (a phone's
  status bar by default: its clock would make every screenshot a new state). Two hashes within
  ``threshold`` bits are one state.
- **exact**: the screenshot's sha256, the strict mode (any changed pixel is another state).

Keys of different kinds never match. ``Clusters`` assigns step groups: equal keys for gym and
exact; for phash the first earlier group whose first hash is within the threshold (a greedy
leader clustering, in the group's episode order, so the same steps always give the same groups).
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

from cua_rl.credit.config import StateKeyConfig
from cua_rl.errors import ConfigError

GYM, PHASH, EXACT = "gym", "phash", "exact"
# What a gym's action answer names (docs/gym.md, *State keys*).
BEFORE_FIELD, AFTER_FIELD = "state_key_before", "state_key_after"


@dataclass(frozen=True)
class StateKey:
    """A state's name: its kind (gym, phash, exact) and value (the gym's string, or hex)."""

    kind: str
    value: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}"

    @classmethod
    def parse(cls, text: str) -> StateKey:
        kind, _, value = text.partition(":")
        return cls(kind, value)


def require_imagehash() -> None:
    """A clear error where a perceptual hash is configured and ``imagehash`` is missing."""
    try:
        import imagehash  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "step_credit.key.mode=auto or phash hashes screenshots with the imagehash package, "
            f"which does not import here ({exc}): pip install imagehash (pinned in "
            "requirements/project.txt; the cua-rl[credit] extra), or set "
            "step_credit.key.mode=gym or exact"
        ) from None


def phash_of(data: bytes, config: StateKeyConfig) -> StateKey:
    """The perceptual hash of an encoded screenshot, its masked regions blanked first."""
    import imagehash
    from PIL import Image, ImageDraw

    with Image.open(io.BytesIO(data)) as img:
        image = img.convert("RGB")
    if config.mask:
        draw = ImageDraw.Draw(image)
        w, h = image.size
        for x0, y0, x1, y1 in config.mask:
            draw.rectangle((x0 * w, y0 * h, x1 * w, y1 * h), fill=(0, 0, 0))
    return StateKey(PHASH, str(imagehash.phash(image, hash_size=config.hash_size)))


def exact_of(digest: str) -> StateKey:
    """The strict key: the screenshot's sha256 (the trajectory's image hash)."""
    return StateKey(EXACT, digest)


def gym_key(value: Any) -> StateKey | None:
    """The gym's key from an answer's field, when it is a non-empty string."""
    if isinstance(value, str) and value:
        return StateKey(GYM, value)
    return None


def image_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def distance(a: StateKey, b: StateKey) -> int | None:
    """Bits between two phash keys (None when either is not one)."""
    if a.kind != PHASH or b.kind != PHASH:
        return None
    import imagehash

    return int(imagehash.hex_to_hash(a.value) - imagehash.hex_to_hash(b.value))


def same_state(a: StateKey | None, b: StateKey | None, config: StateKeyConfig) -> bool:
    """Whether two keys name one state (keys of different kinds never do)."""
    if a is None or b is None or not a.kind or a.kind != b.kind:
        return False
    if a.kind == PHASH:
        return a.value == b.value or (distance(a, b) or 0) <= config.threshold
    return a.value == b.value


class Clusters:
    """Step groups over keys: ``assign(key)`` gives the group of a key, opening a new one when
    no earlier group matches (``same_state`` against each group's first key)."""

    def __init__(self, config: StateKeyConfig):
        self.config = config
        self.leaders: list[StateKey] = []
        self._exact: dict[StateKey, int] = {}

    def assign(self, key: StateKey) -> int | None:
        """The key's group index; None for a step without a key (it groups with nothing)."""
        if not key.kind:
            return None
        if key.kind != PHASH:
            if key not in self._exact:
                self._exact[key] = len(self.leaders)
                self.leaders.append(key)
            return self._exact[key]
        for i, leader in enumerate(self.leaders):
            if same_state(leader, key, self.config):
                return i
        self.leaders.append(key)
        return len(self.leaders) - 1
