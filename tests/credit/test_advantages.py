"""Step advantages of hand-built groups, and the tokens that carry them, in both row layouts.

Every expected value is worked out by hand in the test (returns, means, which tokens), never
taken from the code under test.
"""

from __future__ import annotations

import pytest
import torch

from cua_rl.credit.advantages import step_credit, token_advantages
from cua_rl.credit.config import StateKeyConfig, StepCreditConfig
from cua_rl.credit.keys import StateKey
from cua_rl.credit.steps import EpisodeSteps, Step, StepsError, episode_steps

PAD = 9  # an image pad token in these hand-built rows


def gym(name: str) -> StateKey:
    return StateKey("gym", name)


def ep(episode_id: int, *steps: tuple[str, str, str | None]) -> EpisodeSteps:
    """Steps 1..n as (state, action, next state), no tokens."""
    return EpisodeSteps(
        episode_id,
        tuple(
            Step(i + 1, gym(key), action, gym(nxt) if nxt else None, (i,))
            for i, (key, action, nxt) in enumerate(steps)
        ),
        (),
    )


def values(credit, e: int) -> dict[int, float]:
    return {step: round(v.advantage, 6) for step, v in credit.values[e].items()}


def test_two_episodes_through_one_state_with_different_outcomes():
    # Both start on page 1 and go to page 2; there A taps Next (success, reward 1) and B taps
    # Erase (failure, 0). Page 1: returns 1 and 0, mean 0.5 -> +0.5 / -0.5; page 2 likewise;
    # the states after (done, erased) are each one step's alone: 0.
    a = ep(1, ("p1", "next", "p2"), ("p2", "next", "done"), ("done", "next", "done"))
    b = ep(2, ("p1", "next", "p2"), ("p2", "erase", "erased"), ("erased", "next", "erased"))
    credit = step_credit([a, b], [1.0, 0.0], StepCreditConfig(enabled=True))
    assert values(credit, 0) == {1: 0.5, 2: 0.5, 3: 0.0}
    assert values(credit, 1) == {1: -0.5, 2: -0.5, 3: 0.0}
    assert credit.values[0][1].size == 2 and credit.values[0][3].size == 1
    s = credit.stats
    assert s["cua/credit/steps"] == 6
    assert s["cua/credit/grouped_share"] == pytest.approx(4 / 6)
    assert s["cua/credit/step_groups"] == 4  # p1, p2, done, erased
    assert s["cua/credit/step_group_size"] == pytest.approx(6 / 4)
    assert s["cua/credit/step_group_size_max"] == 2
    assert s["cua/credit/false_merges"] == 0


def test_discounted_returns_and_std_scaling():
    # gamma 0.5, A succeeds (1) in 3 steps: returns 0.25, 0.5, 1; B fails: 0, 0, 0. Every state
    # shared: advantages (r_A - r_B) / 2 = 0.125, 0.25, 0.5 and their negatives.
    a = ep(1, ("s1", "x", "s2"), ("s2", "x", "s3"), ("s3", "x", None))
    b = ep(2, ("s1", "y", "s2"), ("s2", "y", "s3"), ("s3", "y", None))
    cfg = StepCreditConfig(enabled=True, gamma=0.5)
    credit = step_credit([a, b], [1.0, 0.0], cfg)
    assert values(credit, 0) == {1: 0.125, 2: 0.25, 3: 0.5}
    assert values(credit, 1) == {1: -0.125, 2: -0.25, 3: -0.5}
    # std scaling (unbiased, two values d apart: std = d / sqrt 2): every advantage +-1/sqrt 2.
    scaled = step_credit(
        [a, b], [1.0, 0.0], StepCreditConfig(enabled=True, gamma=0.5, std_scale=True)
    )
    assert all(abs(v) == pytest.approx(2**-0.5, rel=1e-4) for v in values(scaled, 0).values())


def test_a_revisited_state_counts_each_visit():
    # A goes p1 -> p2 -> back to p1 -> p2 and succeeds; B stays on p1 and fails. p1 holds A's
    # steps 1 and 3 and B's steps 1 and 2: returns 1, 1, 0, 0 -> mean 0.5.
    a = ep(
        1, ("p1", "next", "p2"), ("p2", "back", "p1"), ("p1", "next", "p2"), ("p2", "next", None)
    )
    b = ep(2, ("p1", "none", "p1"), ("p1", "none", "p1"))
    credit = step_credit([a, b], [1.0, 0.0], StepCreditConfig(enabled=True))
    assert values(credit, 0) == {1: 0.5, 2: 0.0, 3: 0.5, 4: 0.0}  # p2: A's two visits, equal
    assert values(credit, 1) == {1: -0.5, 2: -0.5}
    assert credit.values[0][1].size == 4


def test_a_false_merge_is_counted_once_per_state_and_action():
    # One key for two states: the same tap leads to two different states. The other action of
    # that key agrees with itself: no merge there.
    a = ep(1, ("k", "tap", "on"), ("on", "tap", None))
    b = ep(2, ("k", "tap", "off"), ("off", "tap", None))
    c = ep(3, ("k", "wait", "k"), ("k", "wait", "k"))
    credit = step_credit([a, b, c], [1.0, 0.0, 0.0], StepCreditConfig(enabled=True))
    assert credit.stats["cua/credit/false_merges"] == 1
    assert credit.values[0][1].false_merge and credit.values[1][1].false_merge
    assert not credit.values[2][1].false_merge


def test_unknown_episodes_and_steps_without_a_key_get_nothing():
    a = ep(1, ("p1", "next", None))
    keyless = EpisodeSteps(2, (Step(1, StateKey("", ""), "next", None, (0,)),), ())
    credit = step_credit([a, keyless, None], [1.0, 0.0, 0.0], StepCreditConfig(enabled=True))
    assert values(credit, 0) == {1: 0.0} and values(credit, 1) == {1: 0.0}
    assert credit.values[2] == {}
    assert credit.stats["cua/credit/unknown_episodes"] == 1
    assert credit.stats["cua/credit/unkeyed_share"] == pytest.approx(1 / 2)


# ---- the tokens of each step, in both row layouts -------------------------------------------


def turn_actions(before: str, after: str) -> list[dict]:
    return [
        {
            "name": "tap",
            "args": {"x": 1, "y": 2},
            "rawResult": {"ok": True, "state_key_before": before, "state_key_after": after},
        }
    ]


def append_only_row(calls: list[tuple[int, int]]) -> dict:
    """One row: per call (prompt tokens, sampled tokens), each prompt ending in one image."""
    ids, mask = [], []
    for prompt, sampled in calls:
        ids += [1] * prompt + [PAD] * 4
        mask += [0] * (prompt + 4)
        ids += [2] * sampled
        mask += [1] * sampled
    return {
        "loss_mask": torch.tensor([mask], dtype=torch.int32),
        "mm_token_type_ids": (torch.tensor([ids]) == PAD).long(),
    }


def test_every_token_of_an_append_only_row_gets_its_steps_advantage():
    # Turns: step 1 (one call), step 2 (asked twice: a re-ask), step 3. One row holds them all:
    # prompt 3 + image 4, then 2 sampled per call: sampled at 7-8, 16-17, 25-26, 34-35.
    row = append_only_row([(3, 2), (3, 2), (3, 2), (3, 2)])
    turns = {
        0: (1, turn_actions("p1", "p2")),
        1: (2, []),  # the re-asked call: its actions went to the step's last call
        2: (2, turn_actions("p2", "done")),
        3: (3, turn_actions("done", "done")),
    }
    images = ["a" * 64, "b" * 64, "b" * 64, "c" * 64]
    steps = episode_steps(
        episode_id=7,
        rows=[row],
        row_images=[images],
        row_turns=[(0, 1, 2, 3)],
        turns=turns,
        images={},
        config=StateKeyConfig(),
    )
    assert [(s.step, str(s.key), s.turns) for s in steps.steps] == [
        (1, "gym:p1", (0,)),
        (2, "gym:p2", (1, 2)),
        (3, "gym:done", (3,)),
    ]
    assert steps.spans == (((7, 9, 1), (16, 18, 2), (25, 27, 2), (34, 36, 3)),)
    other = ep(8, ("p1", "x", "p2"), ("p2", "x", "erased"), ("erased", "x", None))
    credit = step_credit([steps, other], [1.0, 0.0], StepCreditConfig(enabled=True))
    out = token_advantages((2, 40), [[0], [1]], [steps, other], credit, weight=2.0)
    want = torch.zeros(2, 40)
    want[0, 7:9] = want[0, 16:18] = want[0, 25:27] = 2 * 0.5  # steps 1 and 2: +0.5, weight 2
    assert torch.equal(out, want)  # step 3 (done) is alone: 0; row 1 has no spans (no tokens)


def test_every_token_of_a_row_per_call_gets_its_steps_advantage():
    # MAI-UI's window: one row per call, each with its own prompt and images.
    rows = [append_only_row([(5, 3)]), append_only_row([(2, 0), (2, 0), (1, 4)])]
    turns = {0: (1, turn_actions("p1", "p2")), 1: (2, turn_actions("p2", "p3"))}
    steps = episode_steps(
        episode_id=3,
        rows=rows,
        row_images=[["a" * 64], ["a" * 64, "b" * 64, "c" * 64]],
        row_turns=[(0,), (1,)],
        turns=turns,
        images={},
        config=StateKeyConfig(),
    )
    assert steps.spans == (((9, 12, 1),), ((17, 21, 2),))
    worse = ep(4, ("p1", "x", "p2"), ("p2", "x", None))
    credit = step_credit([steps, worse], [0.0, 1.0], StepCreditConfig(enabled=True))
    out = token_advantages((3, 22), [[0, 1], [2]], [steps, worse], credit, weight=1.0)
    assert out[0, 9:12].tolist() == [-0.5] * 3 and out[1, 17:21].tolist() == [-0.5] * 4
    assert out[0].abs().sum() == 1.5 and out[1].abs().sum() == 2.0 and out[2].abs().sum() == 0


def test_the_screenshot_before_each_step_keys_it_when_the_gym_names_none():
    # No rawResult keys: exact mode keys each step by the last image before its output.
    row = append_only_row([(3, 2), (3, 2)])
    cfg = StateKeyConfig(mode="exact")
    steps = episode_steps(
        episode_id=1,
        rows=[row],
        row_images=[["a" * 64, "b" * 64]],
        row_turns=[(0, 1)],
        turns={0: (1, []), 1: (2, [])},
        images={"a" * 64: b"x", "b" * 64: b"y"},
        config=cfg,
    )
    assert [str(s.key) for s in steps.steps] == ["exact:" + "a" * 64, "exact:" + "b" * 64]
    assert steps.steps[0].next_key == steps.steps[1].key


def test_rows_and_turns_that_do_not_line_up_are_refused():
    row = append_only_row([(3, 2), (3, 2)])
    with pytest.raises(StepsError, match="2 runs of sampled tokens for 1 trained turns"):
        episode_steps(
            episode_id=1,
            rows=[row],
            row_images=[["a" * 64, "b" * 64]],
            row_turns=[(0,)],
            turns={0: (1, [])},
            images={},
            config=StateKeyConfig(mode="exact"),
        )


def test_a_re_asked_calls_tokens_touch_the_calls_before_and_spans_tell_them_apart():
    # A re-asked call's prompt is the call before it with its reply, so the two replies' tokens
    # touch: one run of loss mask for two turns. Step 1's call, then step 2 asked twice.
    row = {
        "loss_mask": torch.tensor([[0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1]]),
        "mm_token_type_ids": torch.tensor([[0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]]),
    }
    kwargs = dict(
        episode_id=1,
        rows=[row],
        row_images=[["a" * 64, "b" * 64]],
        row_turns=[(0, 1, 2)],
        turns={0: (1, turn_actions("p1", "p2")), 1: (2, []), 2: (2, turn_actions("p2", "p3"))},
        images={},
        config=StateKeyConfig(),
    )
    with pytest.raises(StepsError, match="2 runs of sampled tokens for 3 trained turns"):
        episode_steps(**kwargs)
    steps = episode_steps(**kwargs, row_spans=[((5, 7, 0), (12, 14, 1), (14, 16, 2))])
    assert steps.spans == (((5, 7, 1), (12, 14, 2), (14, 16, 2)),)
    assert [str(s.key) for s in steps.steps] == ["gym:p1", "gym:p2"]
    with pytest.raises(StepsError, match="not its sampled tokens"):
        episode_steps(**kwargs, row_spans=[((5, 7, 0), (12, 13, 1), (14, 16, 2))])
    # A call that sampled nothing (an empty span) is its step's all the same, with no tokens.
    empty = episode_steps(**kwargs, row_spans=[((5, 7, 0), (12, 12, 1), (12, 16, 2))])
    assert empty.spans == (((5, 7, 1), (12, 12, 2), (12, 16, 2)),)


def test_a_step_that_sent_no_action_has_the_state_it_found():
    # Replies that did not parse reach no device: steps 1, 2 and 4 send nothing, so they are on
    # the state the next action starts from (1, 2) or the last one left (4), by the gym's keys;
    # a screenshot hash would put them in step groups of their own.
    invalid = [{"name": "invalid", "args": {"text": ""}, "rawResult": {"ok": False}}]
    row = append_only_row([(3, 2)] * 5)
    steps = episode_steps(
        episode_id=1,
        rows=[row],
        row_images=[["a" * 64] * 5],
        row_turns=[(0, 1, 2, 3, 4)],
        turns={
            0: (1, invalid),
            1: (2, invalid),
            2: (3, turn_actions("p1", "p2")),
            3: (4, invalid),
            4: (5, turn_actions("p2", "p3")),
        },
        images={"a" * 64: b"not read: every step has a gym key"},
        config=StateKeyConfig(),
    )
    assert [str(s.key) for s in steps.steps] == ["gym:p1"] * 3 + ["gym:p2"] * 2
    assert [str(s.next_key) for s in steps.steps] == [
        "gym:p1",
        "gym:p1",
        "gym:p2",
        "gym:p2",
        "gym:p3",
    ]
