"""Did an action change the state: the definition the audit and training share, and the live
free-reward count a training step reports."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cua_rl.audit.live import episode_scalars, step_share, warning_line
from cua_rl.audit.state import action_effect, episode_effect, rewarded, run_effect


@pytest.mark.parametrize(
    ("name", "result", "effect"),
    [
        ("tap", {"ok": True, "changed": True}, "changed"),
        ("tap", {"ok": False, "error": "nothing to tap", "changed": False}, "unchanged"),
        ("tap", {"ok": True}, "unknown"),  # a gym that does not say
        ("tap", None, "unknown"),
        ("tap", {"ok": True, "changed": "yes"}, "unknown"),
        ("swipe", {"ok": False, "error": "off-screen", "status": 400}, "unchanged"),  # refused
        ("finished", {"ok": True, "error": None}, "unchanged"),  # never reaches the device
        ("invalid", {"ok": False, "error": "parse_error: ..."}, "unchanged"),
        ("ask_user", {"ok": True, "reply": "..."}, "unchanged"),
    ],
)
def test_one_actions_effect(name, result, effect):
    assert action_effect(name, result) == effect


def test_an_episode_changed_the_state_when_one_action_did_and_unknown_stays_unknown():
    assert episode_effect([]) == "unchanged"  # no action at all
    assert episode_effect(["unchanged", "unchanged"]) == "unchanged"
    assert episode_effect(["unchanged", "unknown"]) == "unknown"
    assert episode_effect(["unknown", "changed"]) == "changed"


def _executed(name: str, result) -> dict:
    return {"type": "action_executed", "action": {"name": name, "args": {}, "rawResult": result}}


def test_a_runs_effect_from_its_events():
    events = [
        {"type": "step_start"},
        _executed("tap", {"ok": True, "changed": False}),
        {"type": "model_output"},
        _executed("finished", {"ok": True, "error": None}),
    ]
    assert run_effect(events) == "unchanged"
    assert run_effect([*events, _executed("tap", {"ok": True})]) == "unknown"
    assert run_effect([*events, _executed("tap", {"ok": True, "changed": True})]) == "changed"
    assert run_effect([{"type": "action_executed", "action": "tap"}]) == "unknown"


def test_rewarded_is_a_positive_score_or_a_success():
    assert rewarded(0.5, False) and rewarded(None, True) and rewarded(0.0, True)
    assert not rewarded(0.0, False) and not rewarded(-1.0, None) and not rewarded(None, None)


def _ended(accepted: bool, base: float, success: bool):
    reward = SimpleNamespace(base=base, success=success, reward=base - 0.1)
    return SimpleNamespace(accepted=accepted, reward=reward if accepted else None)


def test_an_episodes_free_reward_scalars():
    assert episode_scalars(_ended(True, 1.0, True), "unchanged", True) == {
        "cua/free_reward": 1.0,
        "cua/free_reward_unknown": 0.0,
        "cua/state_unknown": 0.0,
    }
    assert episode_scalars(_ended(True, 1.0, True), "changed", True)["cua/free_reward"] == 0.0
    assert episode_scalars(_ended(True, 0.0, False), "unchanged", True)["cua/free_reward"] == 0.0
    unknown = episode_scalars(_ended(True, 0.5, False), "unknown", True)
    assert unknown == {
        "cua/free_reward": 0.0,
        "cua/free_reward_unknown": 1.0,
        "cua/state_unknown": 1.0,
    }
    # A rejected episode is counted (as 0) so the step's number is its episodes'.
    assert episode_scalars(_ended(False, 1.0, True), "unchanged", True)["cua/free_reward"] == 0.0


def test_a_step_with_free_reward_warns_with_its_share():
    stats = {"rollout/cua/free_reward": 0.25, "rollout/cua/accepted": 1.0}
    assert step_share(stats) == 0.25
    line = warning_line(3, stats)
    assert line.startswith(
        "warning: step 3: 25% of the episodes that ended since the step before were rewarded "
        "though no action of theirs changed the state"
    )
    assert "python -m cua_rl.audit" in line
    assert warning_line(3, {**stats, "rollout/cua/free_reward": 0.0}) is None
    assert warning_line(3, {"rollout/cua/accepted": 1.0}) is None  # not measured: no warning
