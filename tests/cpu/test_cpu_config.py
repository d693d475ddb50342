"""enable_cpu_training on real AReaL configs loaded through load_expr_config."""

from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path

import pytest
from areal.api.cli_args import GRPOConfig, load_expr_config

from cua_rl.cpu import training as cpu
from cua_rl.errors import ConfigError

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
    assert config.vllm.worker_extension_cls == "cua_rl.cpu.vllm_worker.DiskWeightReloadExtension"
    assert config.vllm.block_size == 32
    for section in (config.actor, config.rollout):
        spec = section.scheduling_spec[0]
        assert spec.cmd == "python -m cua_rl.cpu.rpc_worker"
        assert spec.cpu == 1
        assert spec.env_vars["CUA_VLLM_PYTHON"] == fake_vllm_python
        # AReaL joins env_vars as "K=V,K=V" and splits on "=" (launcher.get_env_vars).
        assert all("," not in v and "=" not in v for v in spec.env_vars.values())
    assert any(line.startswith("actor.weight_update_mode") for line in changes)


def test_second_call_changes_nothing(config, fake_vllm_python):
    cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)
    assert cpu.enable_cpu_training(config, vllm_python=fake_vllm_python) == []


def test_user_values_that_work_on_cpu_are_kept(tmp_path, fake_vllm_python):
    config = _load(tmp_path, "+actor.attn_impl=eager", "+vllm.block_size=64")
    cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)
    assert config.actor.attn_impl == "eager"
    assert config.vllm.block_size == 64


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


def test_server_command_uses_vllm_python_and_our_module(config, fake_vllm_python):
    from areal.api.cli_args import vLLMConfig

    cpu.enable_cpu_training(config, vllm_python=fake_vllm_python)
    args = vLLMConfig.build_args(config.vllm, tp_size=1, pp_size=1, host="127.0.0.1", port=1234)
    cmd = cpu.server_command(args, vllm_python=fake_vllm_python)
    areal_cmd = vLLMConfig.build_cmd_from_args(args)
    assert areal_cmd[:3] == ["python3", "-m", "areal.engine.vllm_ext.areal_vllm_server"]
    assert cmd[:3] == [fake_vllm_python, "-m", "cua_rl.cpu.vllm_server"]
    # Everything after the module is AReaL's own argument list, unchanged.
    assert cmd[3:] == areal_cmd[3:]
    i = cmd.index("--worker-extension-cls")
    assert cmd[i + 1] == "cua_rl.cpu.vllm_worker.DiskWeightReloadExtension"


def test_server_env_drops_the_trainer_site_packages(monkeypatch):
    trainer_site = next(p for p in sys.path if p.endswith("site-packages"))
    base = {
        "PYTHONPATH": os.pathsep.join([os.getcwd(), trainer_site]),
        "VIRTUAL_ENV": "x",
        "KEEP": "1",
    }
    env = cpu.server_env(base)
    assert trainer_site not in env["PYTHONPATH"].split(os.pathsep)
    assert (Path(env["PYTHONPATH"]) / "cua_rl" / "cpu" / "vllm_server.py").exists()
    assert "VIRTUAL_ENV" not in env and env["KEEP"] == "1"
    assert base["VIRTUAL_ENV"] == "x"  # the caller's dict is not modified


def test_server_env_holds_the_server_s_memory_settings_unless_the_worker_sets_them():
    env = cpu.server_env({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"
    assert env["MALLOC_MMAP_THRESHOLD_"] == "65536"
    assert cpu.server_env({})["MALLOC_MMAP_THRESHOLD_"] == "131072"


def test_patch_worker_replaces_areal_launch(monkeypatch, tmp_path):
    import subprocess

    from areal.engine import vllm_remote
    from areal.infra import remote_inf_engine
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # Everything patch_worker replaces is put back after the test.
    original = vllm_remote.VLLMBackend.launch_server
    monkeypatch.setattr(vllm_remote.VLLMBackend, "launch_server", original)
    wait = remote_inf_engine.RemoteInfEngine._wait_for_server
    monkeypatch.setattr(remote_inf_engine.RemoteInfEngine, "_wait_for_server", wait)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"])
    launched = []

    class _Popen:
        def __init__(self, cmd, env, **kwargs):
            launched.append((cmd, env))

    monkeypatch.setattr(subprocess, "Popen", _Popen)
    script = tmp_path / "py"
    script.write_text("")
    monkeypatch.setenv("CUA_VLLM_PYTHON", str(script))
    cpu.patch_worker()
    assert vllm_remote.VLLMBackend.launch_server is not original
    assert remote_inf_engine.RemoteInfEngine._wait_for_server is not wait
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is cpu.packed_sdpa_attention

    # RemoteInfEngine.launch_server fills host with the machine's address and reads it back
    # from the same dict after the call.
    server_args = {"model": "m", "port": 1, "host": "192.0.2.7"}
    vllm_remote.VLLMBackend().launch_server(server_args)
    ((cmd, env),) = launched
    assert cmd[:3] == [str(script), "-m", "cua_rl.cpu.vllm_server"]
    assert cmd[3:] == ["--model", "m", "--port", "1", "--host", "127.0.0.1"]
    assert server_args["host"] == "127.0.0.1"
    assert env["PYTHONPATH"] == str(Path(cpu.__file__).resolve().parents[2])


class _DeadProcess:
    returncode = 3

    def poll(self):
        return 3


class _Config:
    # Far beyond any machine's time to notice a dead process: only waiting for it is caught.
    setup_timeout = 600.0


def test_wait_for_server_fails_fast_when_the_server_dies(monkeypatch):
    import time

    from areal.infra import remote_inf_engine

    monkeypatch.setattr(
        remote_inf_engine.RemoteInfEngine,
        "_wait_for_server",
        remote_inf_engine.RemoteInfEngine._wait_for_server,
    )
    from areal.engine import vllm_remote
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setattr(
        vllm_remote.VLLMBackend, "launch_server", vllm_remote.VLLMBackend.launch_server
    )
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"])
    cpu.patch_worker()

    class _Engine:
        config = _Config()

        def check_health(self, base_url):
            return False

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 3"):
        remote_inf_engine.RemoteInfEngine._wait_for_server(
            _Engine(), "127.0.0.1:9", process=_DeadProcess()
        )
    assert time.monotonic() - t0 < 60  # not the setup_timeout: the dead process was noticed
