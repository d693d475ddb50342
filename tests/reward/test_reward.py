"""Reward semantics and shaping: every expected value here is written out by hand."""

from __future__ import annotations

import pytest

from cua_rl.errors import ConfigError, RejectedEpisode
from cua_rl.reward import (
    ComposeRewardTransforms,
    EpisodeFacts,
    RewardConfig,
    build_shaping,
    compute_reward,
    verdict_from_evaluation,
)


def _answer(**result_overrides):
    """A current genv evaluate answer (docs/design.md, the gym server) with a failed task by default."""
    result = {
        "score": 0.0,
        "success": False,
        "validators": [{"id": "wifi", "pass": False, "score": 0.0, "weight": 1.0}],
    }
    result.update(result_overrides)
    return {"success": True, "result": result}


class _Turn:
    """Hand-written stand-in for a trajectory Turn: only what EpisodeFacts reads."""

    def __init__(self, parsed=True, ok=True, name="tap"):
        self.action_parsed = parsed
        self.action_ok = ok
        self.actions = [{"name": name}] if parsed else [{"name": "invalid"}]


def test_real_zero_score_stays_zero_even_when_call_succeeded():
    out = compute_reward(_answer(score=0.0, success=False))
    assert out.reward == 0.0
    assert out.success is False
    assert out.verdict.source == "score"


def test_top_level_success_is_not_task_success():
    # The evaluate call worked (top-level success) but the task failed.
    out = compute_reward({"success": True, "result": {"success": False}})
    assert out.reward == 0.0 and out.success is False


def test_partial_score_is_kept():
    out = compute_reward(_answer(score=0.5, success=False))
    assert out.reward == 0.5 and out.base == 0.5 and out.success is False


def test_success_flag_without_score_gives_one():
    out = compute_reward({"success": True, "result": {"success": True}})
    assert out.reward == 1.0 and out.success is True and out.verdict.source == "success"


def test_validators_only_weighted_mean():
    answer = {
        "result": {
            "validators": [
                {"id": "a", "pass": True, "weight": 3},
                {"id": "b", "pass": False, "weight": 1},
            ]
        }
    }
    out = compute_reward(answer)
    assert out.reward == pytest.approx(0.75)
    assert out.verdict.source == "validators"
    assert out.success is False  # 0.75 < default threshold 1.0


def test_older_final_result_checks():
    answer = {"final_result": {"checks": [{"passed": True}, {"passed": True}]}}
    out = compute_reward(answer)
    assert out.reward == 1.0 and out.success is True


def test_older_evaluation_result_final_result():
    answer = {"success": True, "evaluation_result": {"final_result": {"score": 0.25}}}
    assert verdict_from_evaluation(answer).score == 0.25


@pytest.mark.parametrize(
    "answer",
    [
        {"success": True},  # call worked, no verdict at all
        {},
        None,
        {"result": {}},
        {"result": {"score": float("nan")}},
        {"result": {"validators": [{"id": "x"}]}},  # neither score nor pass
    ],
)
def test_missing_verdict_is_a_rejection_not_zero(answer):
    with pytest.raises(RejectedEpisode) as exc:
        compute_reward(answer)
    assert exc.value.reason == "no_verdict"


def test_failed_evaluate_call_is_evaluation_failed():
    with pytest.raises(RejectedEpisode) as exc:
        compute_reward({"success": False, "detail": "box gone"})
    assert exc.value.reason == "evaluation_failed"
    assert "box gone" in exc.value.detail


def test_bool_score_is_not_a_number():
    # `score: true` is a malformed verdict, not 1.0; success decides instead.
    v = verdict_from_evaluation({"result": {"score": True, "success": False}})
    assert v.score == 0.0 and v.source == "success"


def test_shaping_composes_in_order():
    cfg = RewardConfig.from_dict(
        {
            "shaping": [
                {"name": "parse_error_penalty", "penalty": 0.1},
                {"step_cost": {"cost": 0.01, "free_steps": 2}},
                {"name": "invalid_action_penalty", "penalty": 0.2},
                {"name": "clip", "low": -0.3, "high": 1.0},
            ]
        }
    )
    facts = EpisodeFacts(steps=5, parse_errors=2, invalid_actions=1)
    # 1.0 - 0.2 (2 parse errors) - 0.03 (3 paid steps) - 0.2 (1 invalid) = 0.57
    out = compute_reward(_answer(score=1.0, success=True), facts, cfg)
    assert out.reward == pytest.approx(0.57)
    assert out.base == 1.0
    # From 0: -0.43, clipped to -0.3.
    out0 = compute_reward(_answer(score=0.0), facts, cfg)
    assert out0.reward == pytest.approx(-0.3)


def test_format_bonus_and_penalty():
    shaping = build_shaping([{"name": "format_bonus", "bonus": 0.1, "penalty": 0.05}])
    assert shaping(0.0, EpisodeFacts(steps=3, parse_errors=0)) == pytest.approx(0.1)
    assert shaping(0.0, EpisodeFacts(steps=3, parse_errors=1)) == pytest.approx(-0.05)
    assert shaping(0.0, EpisodeFacts(steps=0)) == pytest.approx(-0.05)


def test_penalty_cap():
    shaping = build_shaping([{"name": "parse_error_penalty", "penalty": 0.1, "max_total": 0.25}])
    assert shaping(1.0, EpisodeFacts(steps=10, parse_errors=10)) == pytest.approx(0.75)


def test_yaml_config():
    cfg = RewardConfig.from_yaml(
        """
shaping:
  - {name: step_cost, cost: 0.1}
  - scale: {factor: 2}
success_threshold: 0.5
"""
    )
    out = compute_reward(_answer(score=0.6, success=None), EpisodeFacts(steps=2), cfg)
    # (0.6 - 0.2) * 2 = 0.8; no gym flag, 0.6 >= 0.5 -> success
    assert out.reward == pytest.approx(0.8)
    assert out.success is True


@pytest.mark.parametrize(
    "spec, needle",
    [
        ([{"name": "curiosity_bonus"}], "unknown shaping term 'curiosity_bonus'"),
        ([{"name": "step_cost", "costs": 0.1}], "no parameter(s) ['costs']"),
        ([{"name": "step_cost", "cost": -1}], "must be >= 0"),
        ([{"name": "clip", "low": 1, "high": 0}], "must be <= clip.high"),
        ([{"a": 1, "b": 2}], "shaping term"),
        ({"name": "step_cost"}, "must be a list"),
    ],
)
def test_bad_shaping_is_config_error(spec, needle):
    with pytest.raises(ConfigError) as exc:
        RewardConfig.from_dict({"shaping": spec})
    assert needle in str(exc.value)


def test_unknown_config_key():
    with pytest.raises(ConfigError, match="unknown reward config key"):
        RewardConfig.from_dict({"shapping": []})


def test_facts_from_turns():
    turns = [_Turn(), _Turn(parsed=False, ok=False), _Turn(ok=False), _Turn(name="finished")]
    facts = EpisodeFacts.from_turns(turns)
    assert facts == EpisodeFacts(steps=4, parse_errors=1, invalid_actions=1, finished=True)


def test_custom_transform_composes():
    double = ComposeRewardTransforms([lambda r, f: r * 2, lambda r, f: r + f.steps])
    assert double(0.5, EpisodeFacts(steps=3)) == 4.0


def test_accepts_the_genv_client_result():
    from cua_rl.clients.genv import parse_evaluation

    parsed = parse_evaluation(_answer(score=0.5, success=False))
    out = compute_reward(parsed)
    assert (out.reward, out.base, out.success) == (0.5, 0.5, False)
