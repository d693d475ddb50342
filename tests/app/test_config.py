"""The example's configs load through AReaL's own loader, and each validation names its fix."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from areal.api.cli_args import vLLMConfig

from cua_rl.app.config import CUAConfig
from cua_rl.app.config_load import load_config
from cua_rl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PROD = ROOT / "configs" / "cua.yaml"
LOCAL = ROOT / "configs" / "local.yaml"

# What the production file leaves for the operator to fill in.
PROD_REQUIRED = [
    "actor.path=/models/policy",
    "gym.base_url=http://gym.internal:8800",
    "gym.gym_id=android-world",
    "agent.base_url=http://agent.internal:3000",
    "monitor.base_url=http://monitor.internal:8000",
]


def _load(path: Path, tmp_path: Path, *overrides: str) -> CUAConfig:
    # fileroot redirected: the loader writes the resolved config under the stats logger root.
    argv = ["--config", str(path), f"cluster.fileroot={tmp_path}", *overrides]
    return load_config(argv, CUAConfig)


def test_production_config_loads_with_overrides(tmp_path):
    cfg = _load(PROD, tmp_path, *PROD_REQUIRED, "gconfig.n_samples=8", "agent.max_steps=20")
    assert isinstance(cfg, CUAConfig)
    assert cfg.gconfig.n_samples == 8
    # Interpolations follow the override; the group filter counts episodes in groups of 8.
    assert cfg.actor.reward_norm is None
    assert cfg.workflow_settings().group.size == 8
    assert cfg.agent.max_steps == 20
    assert cfg.gym.gym_id == "android-world"
    assert cfg.vllm.model == "/models/policy"
    assert cfg.vllm.max_model_len == 262144
    assert (tmp_path / cfg.experiment_name / cfg.trial_name).exists() or any(
        tmp_path.rglob("*.yaml")
    )


def test_gateway_backend_follows_the_rollout_backend(tmp_path):
    assert _load(PROD, tmp_path / "a", *PROD_REQUIRED).gateway.backend == "vllm"
    cfg = _load(PROD, tmp_path / "b", *PROD_REQUIRED, "rollout.backend=sglang:d4")
    assert cfg.gateway.backend == "sglang"
    # A vLLM without the tokens-in endpoint can still be sampled from as text.
    cfg = _load(
        PROD, tmp_path / "c", *PROD_REQUIRED, "vllm.enable_scale_out=false", "gateway.backend=text"
    )
    assert cfg.gateway.backend == "text"


def test_local_config_loads(tmp_path):
    cfg = _load(LOCAL, tmp_path, "actor.path=/models/tiny", "+gym.selection.limit=3")
    assert cfg.gym.gym_id == "sim"
    assert cfg.gym.selection.limit == 3
    assert cfg.actor.weight_update_mode == "disk"
    assert cfg.monitor.db_path


def test_vllm_command_line_reaches_vllm(tmp_path):
    domains = ["shots.example.com", "cdn.example.com"]
    cfg = _load(
        PROD,
        tmp_path,
        *PROD_REQUIRED,
        f"vllm.allowed_media_domains=[{','.join(domains)}]",
        "agent.screenshot_hosts=[shots.example.com]",
        "trajectory.allowed_image_hosts=[shots.example.com]",
    )
    # The same two calls AReaL's trainer and remote engine make to launch the server.
    args = vLLMConfig.build_args(vllm_config=cfg.vllm, tp_size=1, pp_size=1, port=1234)
    cmd = vLLMConfig.build_cmd_from_args(args)
    i = cmd.index("--limit-mm-per-prompt")
    assert cmd[i + 1] == '{"image": 64, "video": 0}'
    j = cmd.index("--allowed-media-domains")
    assert cmd[j + 1 : j + 1 + len(domains)] == domains
    assert cmd.count("--allowed-media-domains") == 1
    following = cmd[j + 1 + len(domains)]
    assert following.startswith("--"), "domains must be followed by the next flag"
    k = cmd.index("--max-model-len")
    assert cmd[k + 1] == "262144"
    # What the gateway needs of the server: the tokens-in endpoint, logprobs after temperature.
    assert "--enable-scale-out" in cmd
    m = cmd.index("--logprobs-mode")
    assert cmd[m + 1] == "processed_logprobs"


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        (["gym.gym_id=''"], "gym.gym_id"),
        (["gconfig.temperature=0", "gconfig.n_samples=4"], "gconfig.temperature"),
        (["rollout.max_concurrent_rollouts=null"], "rollout.max_concurrent_rollouts"),
        (
            [
                "endpoint.mode=direct",
                "vllm.allowed_media_domains=[cdn.example.com]",
                "agent.screenshot_hosts=[shots.example.com]",
                "trajectory.allowed_image_hosts=[shots.example.com]",
            ],
            "add 'shots.example.com' to vllm.allowed_media_domains",
        ),
        (
            ["agent.screenshot_hosts=[shots.example.com]"],
            "add 'shots.example.com' to trajectory.allowed_image_hosts",
        ),
        (["reward.shaping=[{name:step_costs,cost:0.1}]"], "unknown shaping term 'step_costs'"),
        (["reward.shaping=[{penalty:0.1}]"], "unknown shaping term 'penalty'"),
        (["vllm.limit_mm_per_prompt='image 64'"], "vllm.limit_mm_per_prompt"),
        (["endpoint.mode=direct", "endpoint.base_url=http://vllm:8000"], "ending in /v1"),
        (
            [
                "endpoint.mode=direct",
                "+agent.model_options.constrain=regex",
                "actor.use_decoupled_loss=true",
            ],
            "actor.use_decoupled_loss=false",
        ),
        (["endpoint.mode=proxy"], "endpoint.mode='proxy'"),
        (["endpoint.base_url=http://vllm:8000/v1"], "set endpoint.mode=direct"),
        (["rollout.backend=trtllm:d4"], "use a vllm or sglang backend"),
        (["rollout.backend=sglang:d4", "gateway.backend=vllm"], "set gateway.backend=auto"),
        (["gateway.backend=grpc"], "gateway.backend='grpc'"),
        (["vllm.enable_scale_out=false"], "vllm.enable_scale_out=true"),
        (["vllm.logprobs_mode=raw_logprobs"], "vllm.logprobs_mode=processed_logprobs"),
        (["+agent.model_options.constrain=ascii"], "agent.model_options.parse=lenient"),
        (["gateway.sampling_mismatch=ignore"], "gateway.sampling_mismatch='ignore'"),
        (["gateway.public_host=http://x:1"], "gateway.public_port"),
        (["gateway.model_outage_s=0"], "gateway.model_outage_s=600"),
        (["workflow=MyWorkflow"], "importable dotted path"),
        (["workflow=__main__.MyWorkflow"], "__main__ is not importable"),
        (["failfast.window=-1"], "failfast.window"),
        (["failfast.persist_s=5"], "failfast.persist_s to at least 60"),
    ],
)
def test_each_bad_input_names_its_fix(tmp_path, overrides, fix):
    required = [
        o for o in PROD_REQUIRED if o.split("=")[0] not in {x.split("=")[0] for x in overrides}
    ]
    with pytest.raises(ConfigError) as info:
        _load(PROD, tmp_path, *required, *overrides)
    assert fix in str(info.value)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_nested_library_sections_take_overrides(tmp_path):
    cfg = _load(
        LOCAL,
        tmp_path,
        "actor.path=/models/tiny",
        "+gym.timeouts.read_attempts=1",
        "+agent.driver.deadline_s=42",
        "trajectory.prefix_break_policy=reject",
    )
    assert cfg.gym.timeouts.read_attempts == 1
    assert cfg.agent.driver.deadline_s == 42
    assert cfg.trajectory.prefix_break_policy == "reject"


def test_selective_logits_is_on_by_default_and_can_be_switched_off(tmp_path):
    assert _load(PROD, tmp_path, *PROD_REQUIRED).logits.selective is True
    assert _load(LOCAL, tmp_path, "actor.path=/models/tiny").logits.selective is True
    off = _load(LOCAL, tmp_path, "actor.path=/models/tiny", "logits.selective=false")
    assert off.logits.selective is False


def test_group_level_reward_norm_is_refused_with_the_fix(tmp_path):
    # AReaL's chunks of n_samples rows would mix groups once an episode has several rows.
    with pytest.raises(ConfigError, match=r"actor.reward_norm: null"):
        _load(
            PROD,
            tmp_path,
            *PROD_REQUIRED,
            "actor.reward_norm={mean_level: group, std_level: group, group_size: 4}",
        )
    with pytest.raises(ConfigError, match=r"actor.adv_norm at group level"):
        _load(PROD, tmp_path, *PROD_REQUIRED, "actor.adv_norm.mean_level=group")


def test_several_ppo_minibatches_are_warned_about_at_start_with_the_fix(tmp_path):
    # AReaL's minibatch split (by length) scatters an episode's rows, so a screenshot the rows
    # share would be encoded once per minibatch: loading says so and names the fix.
    from cua_rl.app import config as config_module
    from cua_rl.testing.logs import LogLines

    with LogLines(config_module.log, logging.WARNING) as log:
        _load(PROD, tmp_path / "a", *PROD_REQUIRED)
    assert not [line for line in log.lines if "ppo_n_minibatches" in line]
    with LogLines(config_module.log, logging.WARNING) as log:
        _load(PROD, tmp_path / "b", *PROD_REQUIRED, "actor.ppo_n_minibatches=2")
    [line] = [line for line in log.lines if "ppo_n_minibatches" in line]
    assert "actor.ppo_n_minibatches=2" in line and "set actor.ppo_n_minibatches=1" in line
    with LogLines(config_module.log, logging.WARNING) as log:
        _load(
            PROD,
            tmp_path / "c",
            *PROD_REQUIRED,
            "actor.ppo_n_minibatches=2",
            "actor.vision.pack_episodes=false",
        )
    assert not [line for line in log.lines if "ppo_n_minibatches" in line]
