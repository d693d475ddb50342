"""The trainer's sampling as the gateway applies it: one rule for every request shape, and what
gateway mode refuses or warns about at config time."""

from __future__ import annotations

import pytest
from areal.api.cli_args import EvaluatorConfig, GenerationHyperparameters, SaverConfig

from cua_rl.errors import ConfigError
from cua_rl.gateway.backends import Request, SGLangTokens
from cua_rl.gateway.config import (
    Sampling,
    check_trainer_sampling,
    outage_warning,
    pause_warning,
)
from cua_rl.gateway.requests import sampling_differences

NAMES = {"experiment_name": "e", "trial_name": "t", "fileroot": "f"}


@pytest.mark.parametrize(
    ("sampling", "temperature", "top_k"),
    [
        (Sampling(temperature=0.7, top_k=0), 0.7, -1),
        (Sampling(temperature=0.7, greedy=True), 0.0, -1),
        (Sampling(top_k=10**8), 1.0, -1),  # AReaL's default: no truncation
        (Sampling(top_k=20), 1.0, 20),
    ],
)
def test_every_request_shape_spells_the_distribution_the_same_way(sampling, temperature, top_k):
    vllm = sampling.vllm_params(8)
    sglang = SGLangTokens().body(Request([1], [], None, sampling, 8, "m"))["sampling_params"]
    for params in (vllm, sglang):
        assert (params["temperature"], params["top_k"]) == (temperature, top_k)
    # An agent asking for the same distribution in the other spelling is not overridden.
    _, overridden = sampling_differences({"temperature": temperature, "top_k": 0}, sampling)
    assert ("top_k" in overridden) == (top_k != -1)


def test_lora_and_truncating_sampling_are_refused_in_gateway_mode():
    neutral = GenerationHyperparameters()
    check_trainer_sampling(neutral, use_lora=False)
    with pytest.raises(ConfigError, match="actor.use_lora=false"):
        check_trainer_sampling(neutral, use_lora=True)
    for g in (GenerationHyperparameters(top_p=0.9), GenerationHyperparameters(top_k=50)):
        with pytest.raises(ConfigError, match="gconfig.top_p=1.0 and gconfig.top_k=-1"):
            check_trainer_sampling(g, use_lora=False)


def test_a_step_time_shorter_than_the_pause_bound_warns_when_saving_or_evaluating():
    saver = SaverConfig(**NAMES, freq_epochs=1)
    quiet = SaverConfig(**NAMES)
    evaluator = EvaluatorConfig(**NAMES)
    warning = pause_warning(saver, evaluator, 120.0, 3600.0)
    assert warning and "agent.max_step_time_s=120" in warning
    assert pause_warning(quiet, evaluator, 120.0, 3600.0) is None
    assert pause_warning(saver, evaluator, 7200.0, 3600.0) is None


def test_a_step_time_within_the_outage_bound_warns_with_both_fixes():
    warning = outage_warning(120.0, 600.0)
    assert warning and "agent.max_step_time_s=120" in warning
    assert "gateway.model_outage_s=600" in warning and "e.g. 660" in warning
    assert outage_warning(900.0, 600.0) is None and outage_warning(None, 600.0) is None
