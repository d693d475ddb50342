"""``--help``: answered before the launcher imports AReaL or torch, listing every section of the
config with the class and file that document its fields (cua_rl/app/usage.py)."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import typing
from pathlib import Path

from cua_rl.app.config import CUAConfig
from cua_rl.app.usage import AREAL, SECTIONS, TOP_LEVEL

ROOT = Path(__file__).resolve().parents[2]


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(CUAConfig)
    out = {}
    for f in dataclasses.fields(CUAConfig):
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
        cls = args[0] if len(args) == 1 else hints[f.name]
        if dataclasses.is_dataclass(cls):
            out[f.name] = cls
    return out


def test_every_section_of_the_config_is_listed_with_the_class_and_file_declaring_it():
    declared = _sections()
    listed = {name: (cls, path) for name, _, cls, path in SECTIONS}
    assert listed.keys() == declared.keys()
    for name, (cls_name, path) in listed.items():
        cls = declared[name]
        assert cls.__name__ == cls_name, name
        assert inspect.getsourcefile(cls).endswith(path), (name, inspect.getsourcefile(cls))
    assert AREAL == "areal/api/cli_args.py"
    assert inspect.getsourcefile(CUAConfig).endswith(TOP_LEVEL[3])


def test_help_answers_before_areal_or_torch_is_imported():
    # -X importtime lists every module the process imported, on stderr.
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "examples.cua_agent.train", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    heavy = {m for m in imported if m.split(".")[0] in ("areal", "torch", "transformers", "hydra")}
    assert not heavy, sorted(heavy)[:10]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("usage: .venv/bin/python -m examples.cua_agent.train --config")
    for name, *_ in SECTIONS:
        assert any(line.startswith(f"  {name} ") for line in lines), name
