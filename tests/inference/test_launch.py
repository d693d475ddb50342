"""The rollout worker starts vLLM from the server's own environment (cua_rl.inference.launch),
and the trainer's side sets the workers up for it (cua_rl.inference.config): the same on a GPU
node as in the CPU harness."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from cua_rl.cpu import training as cpu
from cua_rl.errors import ConfigError
from cua_rl.inference import launch


def test_server_command_uses_vllm_python_and_our_module():
    from areal.api.cli_args import vLLMConfig

    config = vLLMConfig(model="/m", worker_extension_cls=launch.WORKER_EXTENSION)
    args = vLLMConfig.build_args(config, tp_size=1, pp_size=1, host="127.0.0.1", port=1234)
    cmd = launch.server_command(args, vllm_python="/envs/vllm/bin/python")
    areal_cmd = vLLMConfig.build_cmd_from_args(args)
    assert areal_cmd[:3] == ["python3", "-m", "areal.engine.vllm_ext.areal_vllm_server"]
    assert cmd[:3] == ["/envs/vllm/bin/python", "-m", "cua_rl.inference.vllm_server"]
    # Everything after the module is AReaL's own argument list, unchanged.
    assert cmd[3:] == areal_cmd[3:]
    i = cmd.index("--worker-extension-cls")
    assert cmd[i + 1] == "cua_rl.inference.vllm_worker.DiskWeightReloadExtension"


def test_server_env_drops_the_trainer_site_packages(monkeypatch):
    trainer_site = next(p for p in sys.path if p.endswith("site-packages"))
    base = {
        "PYTHONPATH": os.pathsep.join([os.getcwd(), trainer_site]),
        "VIRTUAL_ENV": "x",
        "KEEP": "1",
    }
    env = launch.server_env(base)
    assert trainer_site not in env["PYTHONPATH"].split(os.pathsep)
    assert (Path(env["PYTHONPATH"]) / "cua_rl" / "inference" / "vllm_server.py").exists()
    assert "VIRTUAL_ENV" not in env and env["KEEP"] == "1"
    assert base["VIRTUAL_ENV"] == "x"  # the caller's dict is not modified


def test_server_env_holds_the_server_s_memory_settings_unless_the_worker_sets_them():
    env = launch.server_env({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"
    assert env["MALLOC_MMAP_THRESHOLD_"] == "65536"
    assert launch.server_env({})["MALLOC_MMAP_THRESHOLD_"] == "131072"


def test_patch_worker_replaces_areal_launch(monkeypatch, tmp_path):
    import subprocess

    from areal.engine import vllm_remote
    from areal.infra import remote_inf_engine
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from cua_rl.areal.attention import packed_sdpa

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
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is packed_sdpa

    # RemoteInfEngine.launch_server fills host with the machine's address and reads it back
    # from the same dict after the call.
    server_args = {"model": "m", "port": 1, "host": "192.0.2.7"}
    vllm_remote.VLLMBackend().launch_server(server_args)
    ((cmd, env),) = launched
    assert cmd[:3] == [str(script), "-m", "cua_rl.inference.vllm_server"]
    assert cmd[3:] == ["--model", "m", "--port", "1", "--host", "127.0.0.1"]
    assert server_args["host"] == "127.0.0.1"
    assert env["PYTHONPATH"] == launch.PACKAGE_ROOT


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


@pytest.fixture
def areal_launch(monkeypatch):
    """AReaL's launch, start-up wait and sdpa entry, put back after the test; Popen recorded."""
    import subprocess

    from areal.engine import vllm_remote
    from areal.infra import remote_inf_engine
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = vllm_remote.VLLMBackend.launch_server
    monkeypatch.setattr(vllm_remote.VLLMBackend, "launch_server", original)
    wait = remote_inf_engine.RemoteInfEngine._wait_for_server
    monkeypatch.setattr(remote_inf_engine.RemoteInfEngine, "_wait_for_server", wait)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"])
    launched: list[tuple[list[str], dict]] = []

    class _Popen:
        def __init__(self, cmd, env, **kwargs):
            launched.append((cmd, env))

    monkeypatch.setattr(subprocess, "Popen", _Popen)
    return vllm_remote.VLLMBackend, original, launched


def test_the_gpu_worker_starts_vllm_from_its_environment_where_areal_says(
    areal_launch, monkeypatch, tmp_path
):
    from cua_rl.areal import worker

    backend, original, launched = areal_launch
    monkeypatch.setenv("CUA_VLLM_PYTHON", "/envs/vllm-cuda/bin/python")
    worker.apply()
    assert backend.launch_server is not original
    server_args = {"model": "m", "port": 1, "host": "10.1.2.3"}
    backend().launch_server(server_args)
    ((cmd, env),) = launched
    assert cmd[:3] == ["/envs/vllm-cuda/bin/python", "-m", "cua_rl.inference.vllm_server"]
    # A GPU node's server listens on the node's address, which the other nodes reach.
    assert cmd[3:] == ["--model", "m", "--port", "1", "--host", "10.1.2.3"]
    assert env["PYTHONPATH"] == launch.PACKAGE_ROOT


def test_without_an_interpreter_the_worker_keeps_areals_launch(areal_launch, monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from cua_rl.areal import worker
    from cua_rl.areal.attention import packed_sdpa

    backend, original, _ = areal_launch
    monkeypatch.delenv("CUA_VLLM_PYTHON", raising=False)
    worker.apply()
    assert backend.launch_server is original
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is packed_sdpa


@pytest.mark.parametrize(
    ("python", "cpu", "expected"),
    [
        ("", True, ".venv-vllm/bin/python"),
        ("", False, ".venv-vllm-cuda/bin/python"),
        ("envs/vllm/bin/python", False, "envs/vllm/bin/python"),
    ],
)
def test_the_interpreter_defaults_to_the_repository_s_environment(
    monkeypatch, python, cpu, expected
):
    monkeypatch.delenv("CUA_VLLM_PYTHON", raising=False)
    assert launch.resolve_python(python, cpu) == os.path.join(launch.PACKAGE_ROOT, expected)
    assert launch.resolve_python("/abs/python", cpu) == "/abs/python"
    monkeypatch.setenv("CUA_VLLM_PYTHON", "/from/env/python")
    assert launch.resolve_python("", cpu) == "/from/env/python"


def test_an_interpreter_path_areal_cannot_pass_is_refused():
    from cua_rl.inference.config import InferenceSection

    with pytest.raises(ConfigError, match="contains ',' or '='"):
        InferenceSection(python="/envs/a=b/bin/python").check(object())


def test_an_unknown_environment_is_refused():
    from cua_rl.inference.config import InferenceSection

    with pytest.raises(ConfigError, match="inference.environment='docker'; use auto"):
        InferenceSection(environment="docker").check(object())


# -- inference.server: the rollout worker borrows a running server (cua_rl/inference/attach.py)


def _config(tmp_path, *overrides: str):
    from cua_rl.app.train import load_config

    root = launch.PACKAGE_ROOT
    return load_config(
        ["--config", f"{root}/configs/local.yaml", f"cluster.fileroot={tmp_path}",
         "actor.path=/m", *overrides],
        write=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("inference.server=127.0.0.1",), "is not host:port"),
        (("inference.server=127.0.0.1:http",), "is not host:port"),
        (("inference.server=127.0.0.1:8000", "rollout.backend=vllm:d2"), "rollout.backend=vllm:d1"),
        (
            ("inference.server=127.0.0.1:8000", "inference.environment=areal"),
            "only a vLLM server of our own",
        ),
    ],
)
def test_a_server_to_borrow_that_cannot_work_is_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, *overrides)


def test_the_rollout_workers_and_only_they_get_the_server_to_borrow(tmp_path):
    from cua_rl.inference.config import use_own_environment

    config = _config(tmp_path, "inference.server=127.0.0.1:8123")
    changes = use_own_environment(config, "/envs/vllm/bin/python")
    (rollout,) = config.rollout.scheduling_spec
    assert rollout.env_vars[launch.ENV_SERVER] == "127.0.0.1:8123"
    assert all(launch.ENV_SERVER not in s.env_vars for s in config.actor.scheduling_spec)
    assert "rollout.scheduling_spec[0].env_vars: CUA_INFERENCE_SERVER=127.0.0.1:8123" in changes
    without = use_own_environment(_config(tmp_path), "/envs/vllm/bin/python")
    assert not [line for line in without if launch.ENV_SERVER in line]


def test_the_worker_borrows_instead_of_launching(monkeypatch):
    from areal.engine import vllm_remote
    from areal.infra import remote_inf_engine
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from cua_rl.areal import worker
    from cua_rl.inference.attach import AttachError
    from cua_rl.testing.vllm_server import free_port

    # What worker.apply replaces is put back after the test.
    backend = vllm_remote.VLLMBackend
    monkeypatch.setattr(backend, "launch_server", backend.launch_server)
    wait = remote_inf_engine.RemoteInfEngine._wait_for_server
    monkeypatch.setattr(remote_inf_engine.RemoteInfEngine, "_wait_for_server", wait)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"])
    # No such interpreter: a launch would fail to start it, not to reach a server.
    monkeypatch.setenv("CUA_VLLM_PYTHON", "/envs/vllm-cuda/bin/python")
    port = free_port()  # nothing listens there
    monkeypatch.setenv(launch.ENV_SERVER, f"127.0.0.1:{port}")
    worker.apply()
    server_args = {"model": "/m", "port": 1, "host": "10.1.2.3"}
    with pytest.raises(AttachError, match=f"127.0.0.1:{port} cannot be reached"):
        backend().launch_server(server_args)
    # AReaL reads the borrowed server's address back from the same dict.
    assert (server_args["host"], server_args["port"]) == ("127.0.0.1", port)


# In vLLM's interpreter: the model-class record of Qwen2-VL read under each of the launch
# environments given (JSON on argv), one after another, as consecutive launches would; from
# the second on, vLLM's subprocess that imports the model module to read it is made to fail.
_READ_MODELINFO = """
import json, os, sys
from vllm.model_executor.models import registry
from cua_rl.inference.vllm_server import share_modelinfos

def refused(fn):
    raise AssertionError("vLLM read the model class in a subprocess again")

for i, env in enumerate(json.loads(sys.argv[1])):
    os.environ.update(env)
    share_modelinfos()
    if i:
        registry._run_in_subprocess = refused
    model = registry._LazyRegisteredModel(
        "vllm.model_executor.models.qwen2_vl", "Qwen2VLForConditionalGeneration"
    )
    print("read", i, model.inspect_model_cls().supports_multimodal, flush=True)
"""


@pytest.mark.slow
def test_each_launch_has_its_own_cache_root_and_shares_the_model_class_records(tmp_path):
    import json
    import subprocess

    from cua_rl.testing.vllm_server import vllm_python

    base = {"VLLM_CACHE_ROOT": str(tmp_path / "vllm")}
    envs = [launch.launch_env(base) for _ in range(2)]
    roots = [env["VLLM_CACHE_ROOT"] for env in envs]
    assert roots[0] != roots[1] and all(Path(r).parent == tmp_path / "vllm" for r in roots)
    assert {env[launch.ENV_MODELINFOS] for env in envs} == {str(tmp_path / "vllm" / "modelinfos")}
    keys = ("VLLM_CACHE_ROOT", launch.ENV_MODELINFOS, "PYTHONPATH")
    out = subprocess.run(
        [
            str(vllm_python()),
            "-c",
            _READ_MODELINFO,
            json.dumps([{k: e[k] for k in keys} for e in envs]),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-3:] == ["read 0 True", "read 1 True", ""], out.stdout
    for root in roots:
        assert (Path(root) / "modelinfos").resolve() == tmp_path / "vllm" / "modelinfos"
    assert [p.name for p in (tmp_path / "vllm" / "modelinfos").iterdir()] == [
        "vllm-model_executor-models-qwen2_vl-Qwen2VLForConditionalGeneration.json"
    ]
