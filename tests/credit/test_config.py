"""The ``step_credit`` section: off by default, every mistake one error naming its key and fix,
and what AReaL's GAE must leave alone for step advantages to mean what they say refused."""

from __future__ import annotations

import pytest

from cua_rl.credit.config import StateKeyConfig, StepCreditConfig
from cua_rl.errors import ConfigError
from tests.app.conftest import load_local


def test_off_by_default_with_the_gyms_keys_else_a_masked_perceptual_hash(tmp_path):
    cfg = load_local(tmp_path)
    assert cfg.step_credit.enabled is False
    assert cfg.step_credit.key.mode == "auto"
    assert cfg.step_credit.key.mask == [[0.0, 0.0, 1.0, 0.05]]
    assert cfg.workflow_settings().group.step_credit == cfg.step_credit


def test_the_section_reaches_the_group_filter_from_the_command_line(tmp_path):
    cfg = load_local(
        tmp_path,
        "step_credit.enabled=true",
        "step_credit.weight=0.5",
        "step_credit.key.mode=phash",
        "step_credit.key.mask=[[0,0,1,0.1],[0,0.9,1,1]]",
    )
    credit = cfg.workflow_settings().group.step_credit
    assert credit.enabled and credit.weight == 0.5 and credit.key.mode == "phash"
    assert credit.key.mask == [[0.0, 0.0, 1.0, 0.1], [0.0, 0.9, 1.0, 1.0]]


@pytest.mark.parametrize(
    "override, message",
    [
        ("step_credit.key.mode=pixels", "step_credit.key.mode='pixels'; use one of auto, gym"),
        ("step_credit.key.threshold=64", "step_credit.key.threshold=64 must be within 0..63"),
        ("step_credit.key.hash_size=1", "step_credit.key.hash_size=1 must be within 2..32"),
        ("step_credit.key.mask=[[0,0,1]]", "must be [x0, y0, x1, y1] in fractions"),
        ("step_credit.key.mask=[[0,0.5,1,0.2]]", "is empty: x0 < x1 and y0 < y1"),
        ("step_credit.weight=0", "step_credit.weight=0.0 must be > 0"),
        ("step_credit.gamma=0", "step_credit.gamma=0.0 must be within (0, 1]"),
        ("step_credit.max_episodes=0", "step_credit.max_episodes=0 must be >= 1"),
    ],
)
def test_a_bad_value_names_its_key_and_fix(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_local(tmp_path, override)


@pytest.mark.parametrize(
    "override, key",
    [
        ("actor.discount=0.9", "actor.discount=0.9 with step_credit.enabled"),
        ("actor.gae_lambda=0.95", "actor.gae_lambda=0.95 with step_credit.enabled"),
        ("actor.reward_scaling=2", "actor.reward_scaling=2.0 with step_credit.enabled"),
        ("actor.reward_bias=-0.5", "actor.reward_bias=-0.5 with step_credit.enabled"),
        ("actor.mask_no_eos_with_zero=true", "actor.mask_no_eos_with_zero=true with step_credit"),
    ],
)
def test_what_would_change_a_tokens_episode_advantage_is_refused(tmp_path, override, key):
    load_local(tmp_path / "off", override)  # alone it is AReaL's business
    with pytest.raises(ConfigError, match=key):
        load_local(tmp_path / "on", override, "step_credit.enabled=true")


def test_a_missing_imagehash_is_named_where_a_hash_is_configured(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def without_imagehash(name, *args, **kwargs):
        if name == "imagehash":
            raise ImportError("No module named 'imagehash'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_imagehash)
    with pytest.raises(ConfigError, match="pip install imagehash"):
        load_local(tmp_path / "a", "step_credit.enabled=true")
    # The gym's keys and the strict mode need no hash.
    load_local(tmp_path / "b", "step_credit.enabled=true", "step_credit.key.mode=gym")
    load_local(tmp_path / "c", "step_credit.enabled=true", "step_credit.key.mode=exact")


def test_the_dataclasses_refuse_alone_too():
    with pytest.raises(ConfigError, match="mode='x'"):
        StateKeyConfig(mode="x")
    with pytest.raises(ConfigError, match="eps=-1"):
        StepCreditConfig(eps=-1)
    assert StepCreditConfig(key={"mode": "exact"}).key.mode == "exact"
