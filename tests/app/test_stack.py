"""``--check``'s GPU inference stack line.

This machine has neither GPU engine in ``.venv``, so the absent case is the real one; the present
cases put a package on ``sys.path`` with its own dist-info (the version importlib.metadata reads)
and, for vLLM, an ``EngineArgs`` dataclass with or without the fields the gateway's config sets.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cua_rl.app import train
from cua_rl.app.stack import STACKS, stack_check
from cua_rl.app.train import load_config

ROOT = Path(__file__).resolve().parents[2]
CUA = str(ROOT / "configs" / "cua.yaml")
LOCAL = str(ROOT / "configs" / "local.yaml")
SERVICES = [
    "gym.base_url=http://gym:8800", "gym.gym_id=android-world", "agent.base_url=http://agent:3000",
    "monitor.base_url=http://monitor:8000", "actor.path=/models/absent",
]  # fmt: skip


def _cua(*overrides):
    return load_config(["--config", CUA, *SERVICES, *overrides])


def _fake_engine(root: Path, name: str, version: str, fields: tuple[str, ...] = ()) -> None:
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    if name == "vllm":
        (pkg / "engine").mkdir()
        (pkg / "engine" / "__init__.py").write_text("")
        body = "".join(f"    {f}: object = None\n" for f in fields) or "    pass\n"
        (pkg / "engine" / "arg_utils.py").write_text(
            "from dataclasses import dataclass\n\n\n@dataclass\nclass EngineArgs:\n" + body
        )
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.fixture
def engine_path(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in [m for m in sys.modules if m.split(".")[0] in STACKS]:
        del sys.modules[name]


def test_cpu_configs_skip_it_saying_why(tmp_path):
    config = load_config(["--config", LOCAL, f"cluster.fileroot={tmp_path}", "actor.path=/m"])
    result = stack_check(config)
    assert result.ok and result.detail.startswith("skipped: cpu=true")


@pytest.mark.skipif(
    any(importlib.util.find_spec(n) for n in STACKS), reason="a GPU engine is installed here"
)
@pytest.mark.parametrize("backend", ["vllm:d4", "sglang:d4"])
def test_a_missing_engine_names_the_install_command(backend):
    result = stack_check(_cua(f"rollout.backend={backend}"))
    engine = backend.split(":")[0]
    assert not result.ok
    assert f"needs {engine}=={STACKS[engine].version}, not importable" in result.detail
    assert f"make gpu-stack GPU_BACKEND={engine}" in result.detail


def test_the_pinned_sglang_passes(engine_path):
    _fake_engine(engine_path, "sglang", "0.5.10.post1")
    assert stack_check(_cua("rollout.backend=sglang:d4")).ok


def test_an_sglang_of_another_version_is_named(engine_path):
    _fake_engine(engine_path, "sglang", "0.5.9")
    result = stack_check(_cua("rollout.backend=sglang:d4"))
    assert not result.ok and "sglang 0.5.9" in result.detail and "0.5.10.post1" in result.detail


def test_vllm_needs_the_gateway_flags(engine_path):
    _fake_engine(engine_path, "vllm", "0.17.0", ("logprobs_mode",))
    result = stack_check(_cua())
    assert not result.ok and "lacks allowed_media_domains" in result.detail


def test_the_pinned_vllm_with_its_flags_passes(engine_path):
    _fake_engine(engine_path, "vllm", "0.17.0", ("logprobs_mode", "allowed_media_domains"))
    result = stack_check(_cua())
    assert result.ok and result.detail.startswith("vllm 0.17.0 imports")


def test_check_prints_the_stack_line(capsys):
    train.main(["--config", CUA, "--check", *SERVICES, "rollout.backend=sglang:d4"])
    lines = [line for line in capsys.readouterr().out.splitlines() if " stack " in line]
    assert len(lines) == 1 and "sglang" in lines[0]


@pytest.mark.parametrize("engine", sorted(STACKS))
def test_the_make_target_installs_the_checked_version(engine):
    # make -n prints the command without running it; the file it installs pins the same version.
    out = subprocess.run(
        ["make", "-n", "gpu-stack", f"GPU_BACKEND={engine}"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    (req,) = re.findall(r"-r (requirements/\S+)", out)
    pins = (ROOT / req).read_text()
    assert re.search(rf"^{engine}(\[\w+\])?=={re.escape(STACKS[engine].version)}$", pins, re.M)
