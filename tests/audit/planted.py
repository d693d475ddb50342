"""A validator a test plants in a task file (``python: tests.audit.planted:wifi_and_coin``): it
reads a random number, so one action sequence gets different rewards.

Its generator is seeded (``reset``) so a test knows how many of its draws pass: the gym runs in
the test's process and imports this module once.
"""

from __future__ import annotations

import random

_RNG = random.Random(0)


def reset(seed: int) -> None:
    _RNG.seed(seed)


def wifi_and_coin(state, answer_text):
    """Wi-Fi on, and a coin flip: the replay of a correct solution passes half the time."""
    if not state.wifi:
        return False, "wifi is off"
    heads = _RNG.random() < 0.5
    return heads, f"wifi is on and the coin came up {'heads' if heads else 'tails'}"
