"""The selector on hand-made outcomes: what it favours, that nothing starves, determinism."""

from __future__ import annotations

from collections import Counter

import pytest

from cua_rl.curriculum.selector import (
    CurriculumConfig,
    Outcome,
    TaskEstimate,
    estimate_tasks,
    informative_probability,
    select_batch,
)
from cua_rl.errors import ConfigError

UCB = CurriculumConfig(kind="ucb")


def _estimates(tasks: dict[str, tuple[int, int]], version: int = 0) -> list[TaskEstimate]:
    """``{task: (successes, tries)}``; (0, 0) is an untried task."""
    outcomes = [Outcome(t, version, n, s) for t, (s, n) in tasks.items() if n]
    return estimate_tasks(list(tasks), outcomes, decay=UCB.decay)


@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_a_half_solved_task_is_drawn_more_than_unsolved_and_solved_ones(group_size):
    est = _estimates({"never": (0, 20), "always": (20, 20), "half": (10, 20)})
    drawn = Counter()
    for batch in range(300):
        sel = select_batch(est, 1, group_size=group_size, config=UCB, seed=7, batch_index=batch)
        drawn[sel.indices[0]] += 1
    never, always, half = drawn[0], drawn[1], drawn[2]
    assert half > 5 * never and half > 5 * always, drawn
    # The floor still gives the others their turn.
    assert never > 0 and always > 0, drawn


@pytest.mark.parametrize("group_size", [2, 8])
@pytest.mark.parametrize("seed", range(5))
def test_an_untried_task_is_drawn(group_size, seed):
    est = _estimates({"never": (0, 20), "always": (20, 20), "half": (10, 20), "new": (0, 0)})
    no_floor = CurriculumConfig(kind="ucb", floor=0.0)
    sel = select_batch(est, 2, group_size=group_size, config=no_floor, seed=seed, batch_index=0)
    assert 3 in sel.indices, sel


def test_an_untried_task_goes_first_among_settled_ones():
    est = _estimates({"never": (0, 20), "always": (20, 20), "new": (0, 0)})
    no_floor = CurriculumConfig(kind="ucb", floor=0.0)
    for batch in range(10):
        sel = select_batch(est, 1, group_size=8, config=no_floor, seed=1, batch_index=batch)
        assert sel.indices == (2,)


def test_the_floor_keeps_every_task_in_play():
    tasks = {"hopeless": (0, 1000), **{f"t{i}": (50, 100) for i in range(9)}}
    est = _estimates(tasks)

    def draws(config: CurriculumConfig) -> Counter:
        c: Counter = Counter()
        for batch in range(500):
            c.update(
                select_batch(est, 3, group_size=4, config=config, seed=3, batch_index=batch).indices
            )
        return c

    with_floor = draws(CurriculumConfig(kind="ucb", floor=0.05))
    assert with_floor[0] > 0, with_floor
    assert len(with_floor) == 10
    # Without it, the same estimates leave the hopeless task out for good.
    assert draws(CurriculumConfig(kind="ucb", floor=0.0))[0] == 0


def test_same_seed_same_batches_other_seed_other_batches():
    est = _estimates({f"t{i}": (i % 5, 4 + i % 3) for i in range(40)})

    def batches(seed: int) -> list[tuple[int, ...]]:
        return [
            select_batch(est, 8, group_size=4, config=UCB, seed=seed, batch_index=b).indices
            for b in range(20)
        ]

    assert batches(11) == batches(11)
    assert batches(11) != batches(12)
    for batch in batches(11):
        assert len(set(batch)) == 8  # distinct tasks within a batch


def test_floor_one_is_uniform_without_replacement():
    est = _estimates({"never": (0, 20), "always": (20, 20), "half": (10, 20)})
    uniform = CurriculumConfig(kind="ucb", floor=1.0)
    drawn = Counter(
        select_batch(est, 1, group_size=2, config=uniform, seed=0, batch_index=b).indices[0]
        for b in range(3000)
    )
    assert all(900 < drawn[i] < 1100 for i in range(3)), drawn


def test_estimates_weigh_a_tasks_latest_tries_most():
    outcomes = [
        Outcome("a", 0, 4, 0),
        Outcome("a", 2, 4, 4),
        Outcome("b", 5, 2, 1),
        Outcome("elsewhere", 1, 8, 8),  # not a train task: ignored
    ]
    a, b, c = estimate_tasks(["a", "b", "c"], outcomes, decay=0.5)
    assert (a.tries, a.successes) == (8, 4)
    # Version 0 is two versions older than a's newest (2): weight 0.25.
    assert a.weight == pytest.approx(4 * 0.25 + 4)
    assert a.weighted_successes == pytest.approx(4)
    # b's only outcome is its newest, whatever other tasks' versions are.
    assert (b.weight, b.weighted_successes) == (2, 1)
    assert c == TaskEstimate()
    assert a.success() == pytest.approx(5 / 7)


def test_informative_probability():
    assert informative_probability(0.5, 2) == pytest.approx(0.5)
    assert informative_probability(0.0, 8) == 0.0
    assert informative_probability(1.0, 8) == 0.0
    assert informative_probability(0.1, 4) == pytest.approx(1 - 0.1**4 - 0.9**4)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "bandit"}, "uniform, ucb"),
        ({"floor": 1.5}, "floor"),
        ({"decay": 0.0}, "decay"),
        ({"exploration": -1}, "exploration"),
        ({"prior_successes": 0}, "prior"),
        ({"fetch_timeout_s": 0}, "fetch_timeout_s"),
    ],
)
def test_bad_config_says_what_to_fix(fields, message):
    with pytest.raises(ConfigError, match=message):
        CurriculumConfig(**fields)


def test_bad_outcomes_and_batches_are_refused():
    with pytest.raises(ValueError, match="3 successes of 2 tries"):
        Outcome("a", 0, 2, 3)
    est = _estimates({"a": (0, 1), "b": (1, 1)})
    with pytest.raises(ConfigError, match="batch of 3 distinct tasks"):
        select_batch(est, 3, group_size=2, config=UCB, seed=0, batch_index=0)
