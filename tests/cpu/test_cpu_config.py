"""enable_cpu_training on real AReaL configs loaded through load_expr_config."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
from areal.api.cli_args import GRPOConfig, get_py_cmd, load_expr_config, vLLMConfig

from cua_rl.app.config import CUAvLLMConfig
from cua_rl.cpu import training as cpu
from cua_rl.errors import ConfigError
from cua_rl.testing.cache import ensure_model

_YAML = """
experiment_name: cpu-cfg
trial_name: t0
tokenizer_path: {model}
cluster:
  fileroot: {root}/fileroot
  name_resolve:
    type: nfs
    nfs_record_root: {root}/nr
scheduler:
  type: local
rollout:
  backend: "vllm:d1"
  experiment_name: cpu-cfg
  trial_name: t0
actor:
  backend: "fsdp:d1"
  experiment_name: cpu-cfg
  trial_name: t0
  path: {model}
vllm:
  model: {model}
train_dataset:
  path: unused
  type: rl
  batch_size: 2
saver: {{experiment_name: cpu-cfg, trial_name: t0, fileroot: {root}/fileroot}}
recover: {{experiment_name: cpu-cfg, trial_name: t0, fileroot: {root}/fileroot}}
evaluator: {{experiment_name: cpu-cfg, trial_name: t0, fileroot: {root}/fileroot}}
stats_logger: {{experiment_name: cpu-cfg, trial_name: t0, fileroot: {root}/fileroot}}
"""


@pytest.fixture
def fake_vllm_python(tmp_path):
    # A file that exists is all enable_cpu_training checks; it is never executed here.
    path = tmp_path / "vllm-python"
    path.write_text("#!/bin/sh\n")
    return str(path)


def _load(tmp_path: Path, *overrides: str) -> GRPOConfig:
    yaml_path = tmp_path / "cfg.yaml"
    yaml_path.write_text(_YAML.format(model=tmp_path / "model", root=tmp_path))
    config, _ = load_expr_config(["--config", str(yaml_path), *overrides], GRPOConfig)
    return config


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    # Loading an AReaL config takes seconds (hydra + structured merge); load once, copy per test.
    return _load(tmp_path_factory.mktemp("cfg"))


@pytest.fixture
def config(loaded):
    return copy.deepcopy(loaded)


def test_defaults_are_rewritten_for_cpu(config, fake_vllm_python):
    # AReaL's defaults that cannot run without a GPU (asserted so a new AReaL default shows up).
    assert config.actor.weight_update_mode == "xccl"
    assert config.actor.attn_impl == "flash_attention_2"
    assert config.actor.scheduling_spec[0].cmd == "python -m areal.infra.rpc.rpc_server"

    changes = cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)

    assert config.actor.weight_update_mode == "disk"
    assert config.actor.attn_impl == "sdpa"
    assert (
        config.vllm.worker_extension_cls == "cua_rl.inference.vllm_worker.DiskWeightReloadExtension"
    )
    assert config.vllm.block_size == 32
    # One tensor/pipeline rank: the model in the engine core's process (two processes, not
    # three), which vLLM's CPU platform allows only with V1 multiprocessing off.
    assert config.vllm.distributed_executor_backend == "uni"
    for section in (config.actor, config.rollout):
        spec = section.scheduling_spec[0]
        assert spec.cmd == "python -m cua_rl.cpu.rpc_worker"
        assert spec.cpu == 1
        assert spec.env_vars["CUA_VLLM_PYTHON"] == fake_vllm_python
        assert spec.env_vars["OMP_WAIT_POLICY"] == "PASSIVE"
        assert spec.env_vars["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        # AReaL's own vLLMConfig cannot size the KV cache: vLLM CPU's environment does.
        assert spec.env_vars["VLLM_CPU_KVCACHE_SPACE"] == "1"
        # AReaL joins env_vars as "K=V,K=V" and splits on "=" (launcher.get_env_vars).
        assert all("," not in v and "=" not in v for v in spec.env_vars.values())
    assert any(line.startswith("actor.weight_update_mode") for line in changes)


def test_our_vllm_section_sizes_the_kv_cache_below_a_gibibyte(config, fake_vllm_python):
    # vLLM CPU's environment variable counts whole GiB, each touched at the engine's start.
    config.vllm = CUAvLLMConfig(model=config.vllm.model)
    changes = cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)
    assert config.vllm.kv_cache_memory_bytes == 128 * 1024 * 1024
    assert "vllm.kv_cache_memory_bytes: None -> 134217728" in changes
    for section in (config.actor, config.rollout):
        assert "VLLM_CPU_KVCACHE_SPACE" not in section.scheduling_spec[0].env_vars
    # AReaL's launch turns the field into vLLM's flag.
    cmd = get_py_cmd("m", vLLMConfig.build_args(config.vllm, tp_size=1, pp_size=1))
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == "134217728"


def test_a_model_that_needs_more_kv_cache_for_one_request_gets_it(config, fake_vllm_python):
    # One request of 200,000 tokens of the tiny Qwen3-VL's fp32 cache (1 KiB a token: vLLM's
    # own count, tests/inference/test_vllm_server.py) is over 195 MiB; the harness's 128 MiB
    # would not start the server.
    config.actor.path = str(ensure_model("qwen3-vl"))
    config.vllm = CUAvLLMConfig(model=config.actor.path, dtype="float32", max_model_len=200_000)
    changes = cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)
    # 6,250 blocks of 32 tokens and vLLM's null block, rounded up to MiB.
    assert config.vllm.kv_cache_memory_bytes == 196 << 20
    assert f"vllm.kv_cache_memory_bytes: None -> {196 << 20}" in changes


def test_a_kv_cache_size_that_fits_blocks_of_16_but_not_of_32_is_refused(config, fake_vllm_python):
    # The load checks vllm.block_size as configured (16); vLLM CPU runs blocks of 32, which need
    # 16,809,984 bytes for 16,384 tokens of the tiny model (vLLM refused one byte fewer, started
    # with it: docs/areal-cpu.md). 1,025 blocks of 16 pass the load's check.
    config.actor.path = str(ensure_model("qwen3-vl"))
    config.vllm = CUAvLLMConfig(
        model=config.actor.path,
        dtype="float32",
        max_model_len=16384,
        kv_cache_memory_bytes=16793600,
    )
    with pytest.raises(ConfigError, match="set vllm.kv_cache_memory_bytes=16809984 or more"):
        cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)


def test_a_kv_cache_size_the_user_gave_is_kept(config, fake_vllm_python):
    config.vllm = CUAvLLMConfig(model=config.vllm.model, kv_cache_memory_bytes=1 << 30)
    cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)
    assert config.vllm.kv_cache_memory_bytes == 1 << 30


@pytest.mark.parametrize("size", [0, -1])
def test_a_kv_cache_size_that_is_not_positive_says_how_to_fix(size):
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes=.*positive number of bytes"):
        CUAvLLMConfig(kv_cache_memory_bytes=size)


def test_second_call_changes_nothing(config, fake_vllm_python):
    cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)
    assert cpu.enable_cpu_training(config, vllm_python=fake_vllm_python) == []


def test_user_values_that_work_on_cpu_are_kept(tmp_path, fake_vllm_python):
    config = _load(tmp_path, "+actor.attn_impl=eager", "+vllm.block_size=64")
    cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)
    assert config.actor.attn_impl == "eager"
    assert config.vllm.block_size == 64


def test_a_server_of_several_ranks_keeps_its_worker_processes(tmp_path, fake_vllm_python):
    # Tensor parallelism needs one worker process per rank: "uni" would be refused by vLLM.
    config = _load(tmp_path, "rollout.backend=vllm:d1t2")
    cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)
    assert config.vllm.distributed_executor_backend == "mp"


def _set(config, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    obj = config
    for name in parents:
        obj = getattr(obj, name)
    setattr(obj, leaf, value)


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("rollout.backend", "sglang:d1", "'vllm:d1'"),
        ("actor.backend", "megatron:d1", "'fsdp:d1'"),
        ("actor.use_lora", True, "set actor.use_lora=false"),
        ("scheduler.type", "kubernetes", "set scheduler.type=local"),
    ],
)
def test_settings_that_cannot_run_on_cpu_are_refused(config, fake_vllm_python, key, value, needle):
    _set(config, key, value)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)


@pytest.mark.parametrize("scheduler", ["ray", "slurm"])
def test_ray_and_slurm_workers_reserve_little_memory(config, fake_vllm_python, scheduler):
    """Both reserve scheduling_spec.mem (GiB, default 32) per worker; a small node has less."""
    config.scheduler.type = scheduler
    changes = cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)
    for section in (config.actor, config.rollout):
        assert [spec.mem for spec in section.scheduling_spec] == [cpu.WORKER_MEM_GIB]
    assert any(".mem: 32 -> 1" in line for line in changes), changes


def test_slurm_tasks_export_the_env_vars_a_container_would_get(config, fake_vllm_python):
    """AReaL passes env_vars only into an Apptainer container; native tasks export them."""
    config.scheduler.type = "slurm"
    cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)
    spec = config.rollout.scheduling_spec[0]
    exports = [line for line in spec.additional_bash_cmds if line.startswith("export ")]
    assert exports == [f"export {k}={v}" for k, v in spec.env_vars.items()]
    assert f"export {cpu.ENV_VLLM_PYTHON}={fake_vllm_python}" in exports
    assert cpu.enable_cpu_training(config, vllm_python=fake_vllm_python) == []


def test_the_local_scheduler_keeps_the_memory_setting(config, fake_vllm_python):
    before = [spec.mem for spec in config.actor.scheduling_spec]
    cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)
    assert [spec.mem for spec in config.actor.scheduling_spec] == before


def test_a_custom_worker_command_is_refused(config, fake_vllm_python):
    config.actor.scheduling_spec[0].cmd = "python my_worker.py"
    with pytest.raises(ConfigError, match=re.escape("python -m cua_rl.cpu.rpc_worker")):
        cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)


def test_missing_vllm_interpreter_says_how_to_fix(config, tmp_path):
    with pytest.raises(ConfigError, match="make venv-vllm"):
        cpu.enable_cpu_training(config, vllm_python=str(tmp_path / "nope" / "python"))
