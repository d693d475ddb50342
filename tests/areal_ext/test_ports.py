"""Two processes seeded alike by AReaL draw different free ports once the choice is unseeded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# What a trainer does before it allocates its workers' ports: AReaL's seeding, then the draw.
_DRAW = """
import json, sys
from areal.utils import seeding
from areal.utils.network import find_free_ports
if sys.argv[1] == "unseeded":
    from cua_rl.areal_ext.ports import unseed_port_choice
    unseed_port_choice()
seeding.set_random_seed(1, key="trainer0")
print(json.dumps(find_free_ports(6)))
"""


def _draws(mode: str) -> list[list[int]]:
    runs = [
        subprocess.run(
            [sys.executable, "-c", _DRAW, mode], capture_output=True, text=True, timeout=120
        )
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]


@pytest.mark.slow
def test_seeded_draws_collide_and_unseeded_draws_do_not():
    # The failure the patch removes: AReaL's seeded draw gives both processes the same ports.
    first, second = _draws("seeded")
    assert first == second
    first, second = _draws("unseeded")
    assert len(first) == len(second) == 6
    # Six ports of 22,768 drawn twice from OS entropy: equal draws would take a 1e-26 chance.
    assert first != second, (first, second)


def test_unseeding_is_idempotent_and_keeps_the_global_random_seeded():
    import random

    from areal.utils import network

    from cua_rl.areal_ext.ports import unseed_port_choice

    unseed_port_choice()
    chooser = network.random
    unseed_port_choice()
    assert network.random is chooser
    assert isinstance(chooser, random.SystemRandom)
    random.seed(7)
    a = random.random()
    network.find_free_ports(2)
    random.seed(7)
    assert random.random() == a
