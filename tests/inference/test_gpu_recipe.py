"""docs/gpu.md's *A fresh GPU node* recipe, and the Apptainer image that installs the same way.

No GPU and no install here: every command of the recipe names an environment's own interpreter
(never this machine's ``.venv``), each ``make`` command is what the Makefile runs (``make -n``),
with the trainer's Python required and checked before anything installs, the ``--check`` and
training commands load, and ``containers/cua-rl.def`` installs with the recipe's own commands
from files it copies. Apptainer itself is packaged neither in Debian 12 nor on PyPI, so the
definition is read, not built. The versions the recipe's table gives are held to uv's
resolutions in ``test_environments.py`` (slow, the registry).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from cua_rl.inference import environments as envs

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "gpu.md"
DEF = ROOT / "containers" / "cua-rl.def"
SECTION = "## A fresh GPU node to a running `configs/cua.yaml`"
GPU_INTERPRETERS = {
    ".venv-gpu/bin/python",
    ".venv-gpu-sglang/bin/python",
    ".venv-vllm-cuda/bin/python",
}
# The recipe's install commands, in order: what the image must run too.
INSTALLS = [
    "python3.12 -m venv .venv-gpu",
    "make gpu-trainer GPU_PYTHON=.venv-gpu/bin/python",
    "make gpu-stack GPU_VENV_PYTHON=python3.12",
]


def recipe_text() -> str:
    text = DOC.read_text()
    assert SECTION in text, "docs/gpu.md lost its fresh-node recipe"
    body = text.split(SECTION, 1)[1]
    return body.split("\n## ", 1)[0]


def recipe_commands() -> list[str]:
    """Each command of the recipe's bash blocks, continuation lines joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", recipe_text(), re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if line.strip():
                out.append(" ".join(line.split()))
    return out


def _words(command: str) -> list[str]:
    words = shlex.split(command)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words.pop(0)
    return words


def test_every_command_names_the_environment_it_runs_in():
    commands = recipe_commands()
    assert len(commands) >= 8, commands
    pythons = []
    for command in commands:
        first = _words(command)[0]
        if "python" in first:
            pythons.append(first)
            assert first in GPU_INTERPRETERS or first == "python3.12", command
    # Every GPU environment's interpreter is named (run, or given to make); this machine's never.
    text = " ".join(commands)
    assert all(i in text for i in GPU_INTERPRETERS), commands
    assert {".venv-gpu/bin/python", ".venv-vllm-cuda/bin/python"} <= set(pythons), pythons
    assert ".venv/bin/python" not in text
    assert [c for c in commands if c in INSTALLS] == INSTALLS


def test_the_table_gives_each_environments_python_and_driver():
    rows = [ln for ln in recipe_text().splitlines() if ln.startswith("| ")][1:]
    by_interpreter = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        by_interpreter[cells[1].split()[0].strip("`,")] = cells
    for interpreter in GPU_INTERPRETERS:
        cells = by_interpreter[interpreter]
        assert cells[2] == envs.PYTHON, cells  # the Python the resolutions are made for
        assert "R580" in cells[4] or "as the trainer's" in cells[4], cells
    assert by_interpreter[".venv/bin/python"][2] == "3.11"
    assert "580.65.06" in recipe_text() and "NVIDIA's CUDA 13.0 release notes" in recipe_text()
    makefile = (ROOT / "Makefile").read_text()
    assert f"GPU_PY_VERSION := {envs.PYTHON}" in makefile
    assert f"GPU_VENV_PYTHON ?= python{envs.PYTHON}" in makefile


def _make(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_")}
    return subprocess.run(
        ["make", "--no-print-directory", *args], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip


def test_make_gpu_trainer_refuses_without_the_python_it_installs_into(tmp_path):
    """It used to install AReaL's whole tree into whatever python3 came first on PATH."""
    bare = _make("gpu-trainer")
    assert bare.returncode == 2
    assert "GPU_PYTHON" in bare.stdout and "python3.12 -m venv .venv-gpu" in bare.stdout
    assert "uv" not in bare.stdout + bare.stderr.replace("GPU_", "")
    # A Python that is not the one the environments are resolved for (this one: 3.11).
    wrong = _make("gpu-trainer", f"GPU_PYTHON={sys.executable}")
    assert wrong.returncode == 2
    assert f"is not a Python {envs.PYTHON}" in wrong.stdout and "Python 3.11" in wrong.stdout
    missing = _make("gpu-trainer", f"GPU_PYTHON={tmp_path / 'python'}")
    assert missing.returncode == 2 and "not found" in missing.stdout
    sglang = _make("gpu-stack", "GPU_BACKEND=sglang")
    assert sglang.returncode == 2 and "GPU_BACKEND=sglang GPU_PYTHON=" in sglang.stdout


def test_each_make_command_of_the_recipe_is_what_the_makefile_runs():
    makes = [c for c in recipe_commands() if c.startswith("make ")]
    assert len(makes) == 3, makes
    for command in makes:
        dry = _make("-n", *shlex.split(command)[1:])
        assert dry.returncode == 0, (command, dry.stderr)
        installs = [ln for ln in dry.stdout.splitlines() if " install " in ln]
        assert installs, dry.stdout
        if "gpu-trainer" in command:
            (line,) = [ln for ln in installs if "uv pip install" in ln]
            assert "--python .venv-gpu/bin/python" in line and '"areal==1.0.4" -e .' in line
            assert "--override requirements/areal-overrides.txt" in line
        elif "GPU_BACKEND=sglang" in command:
            (line,) = [ln for ln in installs if "uv pip install" in ln]
            assert "--python .venv-gpu-sglang/bin/python" in line
            # The SGLang route's trainer: cua-rl with it, as make gpu-envs resolves it.
            assert "requirements/gpu-sglang.txt" in line and line.endswith(" -e .")
        else:
            assert "python3.12 -m venv .venv-vllm-cuda" in dry.stdout
            assert any(
                ".venv-vllm-cuda/bin/python" in ln and "gpu-vllm.txt" in ln for ln in installs
            )


def test_the_check_and_training_command_loads(tmp_path, tiny_vl_model_dir):
    from cua_rl.app.config_load import load_config

    (check,) = [c for c in recipe_commands() if "examples.cua_agent.train" in c]
    words = _words(check)
    assert words[0] == ".venv-gpu/bin/python" and "--check" in words
    argv = [a for a in words[3:] if a != "--check"]
    argv = [f"actor.path={tiny_vl_model_dir}" if a.startswith("actor.path=") else a for a in argv]
    argv = [str(ROOT / a) if a.endswith(".yaml") else a for a in argv]
    config = load_config(
        [*argv, f"cluster.fileroot={tmp_path}", f"cluster.name_resolve.nfs_record_root={tmp_path}"],
        write=False,
    )
    assert not config.cpu and config.monitor.base_url and config.gym.gym_id


# ---------------------------------------------------------------------------- the image


def definition() -> tuple[dict[str, str], dict[str, list[str]]]:
    """The definition's header (``Bootstrap``, ``From``) and its sections' lines."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current = None
    for raw in DEF.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("%"):
            current = line[1:].split()[0]
            sections[current] = []
        elif current is None:
            key, _, value = line.partition(":")
            header[key.strip()] = value.strip()
        else:
            sections[current].append(line)
    return header, sections


def _commands(lines: list[str]) -> list[str]:
    return [" ".join(c.split()) for c in re.sub(r"\\\n\s*", " ", "\n".join(lines)).splitlines()]


def test_the_image_installs_with_the_recipes_commands_in_order():
    header, sections = definition()
    assert header == {"Bootstrap": "docker", "From": "ubuntu:24.04"}
    assert {"files", "post", "environment"} <= set(sections)
    post = _commands(sections["post"])
    at = [post.index(c) for c in INSTALLS]  # each of the recipe's, as the docs write it
    assert at == sorted(at), post
    # Ubuntu 24.04's python3.12, the Python every GPU environment is resolved for.
    assert any(c.startswith("apt-get install") and f"python{envs.PYTHON}-venv" in c for c in post)
    assert post.index("cd /opt/cua-rl") < at[0]
    env = "\n".join(sections["environment"])
    assert "export PATH=/opt/cua-rl/.venv-gpu/bin:$PATH" in env
    assert "export CUA_VLLM_PYTHON=/opt/cua-rl/.venv-vllm-cuda/bin/python" in env


def test_the_files_the_image_copies_are_enough_for_its_install(tmp_path):
    """The install runs in /opt/cua-rl holding only what %files copies: every file the
    make commands and ``pip install -e .`` read is among them."""
    _, sections = definition()
    copy = tmp_path / "opt-cua-rl"
    copy.mkdir()
    for line in sections["files"]:
        source, target = line.split()
        assert target == f"/opt/cua-rl/{source}", line
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(src, copy / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, copy / source)
    for command in INSTALLS[1:]:
        dry = _make("-n", *shlex.split(command)[1:], cwd=copy)
        assert dry.returncode == 0, dry.stderr
        named = set(re.findall(r"requirements/[\w.-]+\.txt", dry.stdout))
        assert named and all((copy / p).is_file() for p in named), named
    import tomllib

    project = tomllib.loads((copy / "pyproject.toml").read_text())
    assert (copy / project["project"]["readme"]).is_file()
    for package in ("cua_rl", "examples"):
        assert (copy / package / "__init__.py").is_file()
    # The workers' entry point and the worker-side workflow the config names.
    assert (copy / "cua_rl" / "areal" / "worker.py").is_file()
    assert (copy / "examples" / "cua_agent" / "workflow.py").is_file()


def test_the_sglang_route_named_in_the_recipe_is_what_make_gpu_envs_resolves():
    """The SGLang route's trainer holds cua-rl too: the resolution make gpu-envs checks is that
    of the environment the recipe creates (make gpu-stack GPU_BACKEND=sglang installs both)."""
    env = envs.environments()["sglang"]
    assert "SGLang route's trainer" in env.what and "cua-rl" in env.what
    assert set(envs.project_dependencies()) <= set(env.requirements)
