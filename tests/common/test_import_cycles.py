"""No two modules of cua_rl import each other, directly or through others (scripts/import_cycles.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location(
        "import_cycles", ROOT / "scripts/import_cycles.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cua_rl_has_no_import_cycle():
    assert _checker().find_cycles(ROOT / "cua_rl") == []


def test_the_checker_finds_a_cycle_through_a_deferred_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (package / "c.py").write_text("import pkg.a as a\n")
    (package / "d.py").write_text("from pkg import a\n")  # imports into the cycle, not part of it
    assert _checker().find_cycles(package) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
