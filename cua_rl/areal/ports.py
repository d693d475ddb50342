"""AReaL's free-port choice, made independent of the training seed.

``areal.utils.network.find_free_ports`` draws candidate ports with the module-level ``random``,
which ``areal.utils.seeding.set_random_seed`` seeds from the config's ``seed`` and a role key
(``trainer0``, ``actor0``, ...). Two trainings with the same seed on one machine therefore draw
the same ports in the same order, and a port one of them has chosen but not yet bound (the gloo
store's ``MASTER_PORT``, a worker's server port) looks free to the other: both bind it and one
dies with EADDRINUSE. That is what failed CI when two trainings of ``configs/local.yaml`` ran in
the two pytest processes side by side, and it would happen to two jobs of one config sharing a
node. The draw only has to avoid collisions, so it gets an OS-seeded generator of its own; the
seeded ``random`` that AReaL and the model code rely on is left alone.

The upstream change this stands for: ``find_free_ports`` drawing from ``random.SystemRandom()``.
"""

from __future__ import annotations

import random


def unseed_port_choice() -> None:
    """Make ``find_free_ports`` draw from OS entropy, in this process (idempotent).

    The function looks ``random`` up in its module's globals at every call, so replacing that
    name reaches every caller, also those that imported the function by name before this ran.
    """
    from areal.utils import network

    if not isinstance(network.random, random.SystemRandom):
        network.random = random.SystemRandom()
