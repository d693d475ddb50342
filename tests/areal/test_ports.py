"""Two trainings seeded alike by AReaL draw different free ports once the choice is unseeded."""

from __future__ import annotations

import random

from areal.utils import network, seeding

from cua_rl.areal.ports import unseed_port_choice


def _trainer_draw() -> list[int]:
    # What a trainer does before it allocates its workers' ports: AReaL's seeding, then the draw.
    seeding.set_random_seed(1, key="trainer0")
    return network.find_free_ports(6)


def test_seeded_draws_collide_and_unseeded_draws_do_not(monkeypatch):
    # AReaL's own draw (the module's global random): two trainings of one seed get the same ports.
    monkeypatch.setattr(network, "random", random)
    assert _trainer_draw() == _trainer_draw()
    unseed_port_choice()
    first, second = _trainer_draw(), _trainer_draw()
    assert len(first) == len(second) == 6
    # Six ports of 22,768 drawn twice from OS entropy: equal draws would take a 1e-26 chance.
    assert first != second, (first, second)


def test_unseeding_is_idempotent_and_keeps_the_global_random_seeded(monkeypatch):
    monkeypatch.setattr(network, "random", random)
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
