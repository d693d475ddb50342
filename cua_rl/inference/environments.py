"""The GPU environments this project documents, resolved without a GPU and without installing.

A GPU node runs two environments (docs/gpu.md):

- ``trainer``: AReaL 1.0.4 as AReaL itself resolves it (the overrides of its own pyproject,
  ``requirements/areal-overrides.txt``) with cua-rl's dependencies (``pyproject.toml``);
- ``vllm``: the inference server's own (``requirements/gpu-vllm.txt``).

``sglang`` is the other route's trainer environment: AReaL's sglang extra with cua-rl, resolved
with the same overrides; SGLang pins its own torch (2.9.1 against the vLLM route's 2.10.0), so it
is an environment of its own (``make gpu-stack GPU_BACKEND=sglang``, docs/gpu.md). Each is resolved by uv's ``pip compile`` for linux x86_64 / CPython 3.12 (the
platform is named, so this machine's needs nothing of it), reading package metadata from the
registry, sdists included. ``into(requirements, environment)`` resolves a requirements file
against an environment's resolved pins as constraints: what ``pip install -r`` into that
environment would have to satisfy, where a conflict means the install would break its pins.

    python -m cua_rl.inference.environments            # every environment, one line each
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from cua_rl.errors import CuaRlError

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements"
AREAL = "areal==1.0.4"
PLATFORM = "x86_64-manylinux_2_28"
PYTHON = "3.12"


@dataclass(frozen=True)
class Environment:
    name: str
    requirements: tuple[str, ...]  # requirement lines
    overrides: Path | None = None
    what: str = ""


@dataclass
class Resolution:
    environment: str
    ok: bool
    pins: dict[str, str] = field(default_factory=dict)  # lower-case name -> version
    reason: str = ""  # the resolver's explanation when not ok

    def line(self) -> str:
        if not self.ok:
            return f"FAIL {self.environment}: {self.reason}"
        shown = ", ".join(
            f"{n} {self.pins[n]}"
            for n in ("areal", "vllm", "sglang", "torch", "transformers")
            if n in self.pins
        )
        return f"ok   {self.environment}: {len(self.pins)} packages ({shown})"


def project_dependencies() -> tuple[str, ...]:
    """cua-rl's own runtime dependencies, as ``pip install -e .`` asks for them."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return tuple(data["project"]["dependencies"])


def requirement_lines(path: Path) -> tuple[str, ...]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return tuple(line for line in lines if line)


def environments() -> dict[str, Environment]:
    overrides = REQUIREMENTS / "areal-overrides.txt"
    return {
        "trainer": Environment(
            "trainer",
            (AREAL, *project_dependencies()),
            overrides,
            "AReaL 1.0.4 with its overrides, and cua-rl (make gpu-trainer)",
        ),
        "vllm": Environment(
            "vllm",
            requirement_lines(REQUIREMENTS / "gpu-vllm.txt"),
            None,
            "the inference server's own environment (make gpu-stack)",
        ),
        "sglang": Environment(
            "sglang",
            (*requirement_lines(REQUIREMENTS / "gpu-sglang.txt"), *project_dependencies()),
            overrides,
            "the SGLang route's trainer: AReaL's sglang extra and cua-rl, SGLang's torch "
            "(make gpu-stack GPU_BACKEND=sglang into an environment of its own)",
        ),
    }


def uv() -> str:
    found = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(found).exists():
        raise CuaRlError("uv is not installed: pip install uv (requirements/project.txt pins it)")
    return found


def compile_requirements(
    name: str,
    requirements: tuple[str, ...],
    *,
    overrides: Path | None = None,
    constraints: dict[str, str] | None = None,
    timeout_s: float = 900,
) -> Resolution:
    """uv's resolution of ``requirements`` for linux x86_64 / CPython 3.12."""
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.in"
        req.write_text("\n".join(requirements) + "\n")
        cmd = [uv(), "pip", "compile", str(req), "--python-platform", PLATFORM]
        cmd += ["--python-version", PYTHON, "--python-preference", "only-system"]
        cmd += ["--no-header", "--no-annotate", "--quiet", "--output-file", str(Path(tmp) / "o")]
        if overrides is not None:
            cmd += ["--override", str(overrides)]
        if constraints:
            pins = Path(tmp) / "constraints.txt"
            pins.write_text("".join(f"{n}=={v}\n" for n, v in sorted(constraints.items())))
            cmd += ["--constraint", str(pins)]
        env = {**os.environ, "UV_NO_PROGRESS": "1"}
        env.setdefault("UV_CACHE_DIR", str(ROOT / ".cache" / "uv"))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        if proc.returncode != 0:
            return Resolution(name, False, reason=_explanation(proc.stderr))
        return Resolution(name, True, pins=_pins((Path(tmp) / "o").read_text()))


def _pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.split(";", 1)[0].strip()
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.split("[", 1)[0].strip().lower()] = version.strip()
    return pins


def _explanation(stderr: str) -> str:
    lines = [
        line.strip()
        for line in stderr.splitlines()
        if line.strip() and not line.startswith("warning:")
    ]
    return " ".join(lines)[:1200] or "uv failed without a message"


def resolve(environment: Environment) -> Resolution:
    return compile_requirements(
        environment.name, environment.requirements, overrides=environment.overrides
    )


def into(requirements: Path, environment: Resolution) -> Resolution:
    """``pip install -r requirements`` into ``environment``: resolved with its pins held."""
    if not environment.ok:
        raise CuaRlError(f"{environment.environment} does not resolve: {environment.reason}")
    return compile_requirements(
        f"{requirements.name} into {environment.environment}",
        requirement_lines(requirements),
        constraints=environment.pins,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("names", nargs="*", help="environments to resolve (default: all)")
    args = ap.parse_args(argv)
    known = environments()
    failed = 0
    for name in args.names or list(known):
        if name not in known:
            print(f"unknown environment {name!r}: one of {', '.join(known)}")
            return 2
        result = resolve(known[name])
        print(result.line(), flush=True)
        failed += not result.ok
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
